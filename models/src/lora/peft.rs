//! PEFT's adapter files, both ways: `adapter_config.json` (rank, alpha, targets, patterns) and
//! `adapter_model.safetensors` with keys `base_model.model.<module path>.lora_A.weight` (r, in)
//! and `…lora_B.weight` (out, r). What PEFT can write and this crate cannot run yet (DoRA,
//! `modules_to_save`, biases, Conv1D layouts) is refused with the field named.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::{Adapters, LoraConfig};
use crate::config::Config;
use crate::error::ModelError;

/// The config file's name in an adapter directory.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The weights file's name in an adapter directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

const PREFIX: &str = "base_model.model.";

/// PEFT's key of `which` (`lora_A`, `lora_B`) of the module at `path`.
pub fn key(path: &str, which: &str) -> String {
    format!("{PREFIX}{path}.{which}.weight")
}

fn field(path: &Path, name: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Config {
        path: path.into(),
        field: name.into(),
        reason: reason.into(),
    }
}

/// A [`LoraConfig`] from the text of an `adapter_config.json` (`path` names it in errors).
pub fn parse_config(text: &str, path: &Path) -> Result<LoraConfig, ModelError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| ModelError::file(path, format!("not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ModelError::file(path, "not a JSON object"))?;
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    if let Some(t) = get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(field(
                path,
                "peft_type",
                format!("{t:?}: only LORA adapters are supported"),
            ));
        }
    }
    if get("use_dora").and_then(Value::as_bool) == Some(true) {
        return Err(field(
            path,
            "use_dora",
            "DoRA adapters are not supported yet",
        ));
    }
    if let Some(m) = get("modules_to_save") {
        if m.as_array().is_none_or(|a| !a.is_empty()) {
            return Err(field(
                path,
                "modules_to_save",
                "fully trained modules saved beside the adapter are not supported yet",
            ));
        }
    }
    if let Some(b) = get("bias").and_then(Value::as_str) {
        if b != "none" {
            return Err(field(
                path,
                "bias",
                format!("{b:?}: only \"none\" is supported"),
            ));
        }
    }
    if get("fan_in_fan_out").and_then(Value::as_bool) == Some(true) {
        return Err(field(
            path,
            "fan_in_fan_out",
            "Conv1D-layout (GPT-2) weights are not supported",
        ));
    }
    for flag in ["lora_bias", "use_qalora", "use_bdlora"] {
        if get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(field(path, flag, "not supported yet"));
        }
    }
    for unsupported in [
        "layers_to_transform",
        "layers_pattern",
        "layer_replication",
        "target_parameters",
        "trainable_token_indices",
        "alora_invocation_tokens",
    ] {
        if get(unsupported).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(field(path, unsupported, "not supported yet"));
        }
    }
    let r = match get("r") {
        None => 8,
        Some(v) => v
            .as_u64()
            .filter(|&r| r > 0)
            .ok_or_else(|| field(path, "r", format!("{v}: expected a positive integer")))?
            as usize,
    };
    let alpha = match get("lora_alpha") {
        None => 8.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| field(path, "lora_alpha", format!("{v}: expected a number")))?,
    };
    let dropout = match get("lora_dropout") {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .filter(|d| (0.0..1.0).contains(d))
            .ok_or_else(|| {
                field(
                    path,
                    "lora_dropout",
                    format!("{v}: expected a number in [0, 1)"),
                )
            })? as f32,
    };
    let target_modules = match get("target_modules") {
        None => return Err(field(path, "target_modules", "missing")),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| field(path, "target_modules", format!("{t}: expected a string")))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::String(s)) => {
            return Err(field(
                path,
                "target_modules",
                format!("{s:?}: a regular expression is not supported; list the module names"),
            ))
        }
        Some(v) => {
            return Err(field(
                path,
                "target_modules",
                format!("{v}: expected a list"),
            ))
        }
    };
    let use_rslora = get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let mut rank_pattern = BTreeMap::new();
    if let Some(p) = get("rank_pattern") {
        let p = p
            .as_object()
            .ok_or_else(|| field(path, "rank_pattern", "expected an object"))?;
        for (k, v) in p {
            let r = v.as_u64().filter(|&r| r > 0).ok_or_else(|| {
                field(
                    path,
                    &format!("rank_pattern.{k}"),
                    "expected a positive integer",
                )
            })?;
            rank_pattern.insert(k.clone(), r as usize);
        }
    }
    let mut alpha_pattern = BTreeMap::new();
    if let Some(p) = get("alpha_pattern") {
        let p = p
            .as_object()
            .ok_or_else(|| field(path, "alpha_pattern", "expected an object"))?;
        for (k, v) in p {
            let a = v
                .as_f64()
                .ok_or_else(|| field(path, &format!("alpha_pattern.{k}"), "expected a number"))?;
            alpha_pattern.insert(k.clone(), a);
        }
    }
    Ok(LoraConfig {
        r,
        alpha,
        dropout,
        target_modules,
        use_rslora,
        rank_pattern,
        alpha_pattern,
        base_model_name_or_path: get("base_model_name_or_path")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// The `adapter_config.json` PEFT writes for `config`, its targets the module names
/// `targets`.
pub fn config_json(config: &LoraConfig, targets: &[String]) -> Value {
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "auto_mapping": null,
        "base_model_name_or_path": config.base_model_name_or_path,
        "revision": null,
        "inference_mode": true,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": config.use_rslora,
        "use_dora": false,
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": config.rank_pattern,
        "alpha_pattern": config.alpha_pattern,
    })
}

/// Loads the adapter in `dir` (PEFT's two files) for a model of `cfg`, in F32 on `device`:
/// every tensor is checked against the config (its rank, the module's widths) and the model,
/// errors naming the file and tensor.
pub fn load(dir: &Path, cfg: &Config, device: &Device) -> Result<Adapters, ModelError> {
    let config_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| ModelError::file(&config_path, format!("cannot read: {e}")))?;
    let config = parse_config(&text, &config_path)?;
    let weights_path = dir.join(WEIGHTS_FILE);
    if !weights_path.exists() {
        return Err(ModelError::file(
            &weights_path,
            "missing (adapters saved as adapter_model.bin are not read: save with \
             safe_serialization)",
        ));
    }
    let tensors = candle_core::safetensors::load(&weights_path, &Device::Cpu)
        .map_err(|e| ModelError::file(&weights_path, e))?;
    let bad = |tensor: &str, reason: String| ModelError::Tensor {
        path: weights_path.clone(),
        tensor: tensor.into(),
        reason,
    };
    let mut pairs: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    for (name, t) in &tensors {
        let module = name
            .strip_prefix(PREFIX)
            .and_then(|rest| {
                rest.strip_suffix(".lora_A.weight")
                    .map(|m| (m, true))
                    .or_else(|| rest.strip_suffix(".lora_B.weight").map(|m| (m, false)))
            })
            .ok_or_else(|| {
                bad(
                    name,
                    "not a LoRA weight (expected base_model.model.<module>.lora_A.weight or \
                     .lora_B.weight; embeddings' adapters, DoRA magnitudes and biases are not \
                     supported)"
                        .into(),
                )
            })?;
        let entry = pairs.entry(module.0.to_string()).or_default();
        if module.1 {
            entry.0 = Some(t.clone());
        } else {
            entry.1 = Some(t.clone());
        }
    }
    let mut modules = BTreeMap::new();
    for (path, pair) in pairs {
        let (Some(a), Some(b)) = pair else {
            return Err(bad(&path, "has only one of lora_A and lora_B".into()));
        };
        if a.rank() != 2 || b.rank() != 2 {
            return Err(bad(
                &key(&path, "lora_A"),
                "lora_A and lora_B must be matrices".into(),
            ));
        }
        let r = config.rank_of(&path);
        if a.dim(0)? != r || b.dim(1)? != r {
            return Err(bad(
                &key(&path, "lora_A"),
                format!(
                    "rank {} (lora_A {:?}, lora_B {:?}) but the config gives rank {r}",
                    a.dim(0)?,
                    a.dims(),
                    b.dims()
                ),
            ));
        }
        if !a.dtype().is_float() || !b.dtype().is_float() {
            return Err(bad(&key(&path, "lora_A"), "not a float tensor".into()));
        }
        modules.insert(path, (a, b));
    }
    if modules.is_empty() {
        return Err(ModelError::file(&weights_path, "holds no LoRA weights"));
    }
    let adapters = Adapters::from_tensors(config, modules, device)?;
    adapters.check(cfg).map_err(|reason| ModelError::Tensor {
        path: weights_path.clone(),
        tensor: "lora_A/lora_B".into(),
        reason,
    })?;
    Ok(adapters)
}

/// Writes `adapters` into `dir` (created) as PEFT's two files, the weights in `dtype`.
pub fn save(adapters: &Adapters, dir: &Path, dtype: DType) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::file(dir, format!("cannot create: {e}")))?;
    let mut targets: Vec<String> = adapters
        .modules()
        .keys()
        .map(|p| p.rsplit('.').next().unwrap_or(p).to_string())
        .collect();
    targets.sort();
    targets.dedup();
    let json = config_json(adapters.config(), &targets);
    let config_path = dir.join(CONFIG_FILE);
    let text =
        serde_json::to_string_pretty(&json).map_err(|e| ModelError::file(&config_path, e))?;
    std::fs::write(&config_path, text)
        .map_err(|e| ModelError::file(&config_path, format!("cannot write: {e}")))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (name, var) in adapters.named_vars() {
        tensors.insert(
            name,
            var.as_tensor().to_dtype(dtype)?.to_device(&Device::Cpu)?,
        );
    }
    let weights_path = dir.join(WEIGHTS_FILE);
    candle_core::safetensors::save(&tensors, &weights_path)
        .map_err(|e| ModelError::file(&weights_path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LoraConfig, ModelError> {
        parse_config(text, Path::new("adapter_config.json"))
    }

    #[test]
    fn reads_peft_fields_and_refuses_what_it_cannot_run() {
        let c = parse(
            r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                "target_modules": ["q_proj", "v_proj"], "bias": "none", "use_rslora": true,
                "use_dora": false, "modules_to_save": null, "task_type": "CAUSAL_LM",
                "rank_pattern": {"model.layers.1.self_attn.q_proj": 2},
                "alpha_pattern": {"v_proj": 3}}"#,
        )
        .unwrap();
        assert_eq!((c.r, c.alpha, c.use_rslora), (4, 8.0, true));
        assert_eq!(c.rank_of("model.layers.1.self_attn.q_proj"), 2);
        assert_eq!(c.rank_of("model.layers.0.self_attn.q_proj"), 4);
        assert_eq!(c.scale_of("model.layers.0.self_attn.v_proj"), 3.0 / 2.0);
        assert!(c.targets("model.layers.3.self_attn.v_proj"));
        assert!(!c.targets("model.layers.3.self_attn.k_proj"));
        for (text, name) in [
            (
                r#"{"target_modules": ["q_proj"], "use_dora": true}"#,
                "use_dora",
            ),
            (
                r#"{"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}"#,
                "modules_to_save",
            ),
            (r#"{"target_modules": ["q_proj"], "bias": "all"}"#, "bias"),
            (
                r#"{"target_modules": ["q_proj"], "lora_bias": true}"#,
                "lora_bias",
            ),
            (r#"{"target_modules": ".*proj"}"#, "target_modules"),
            (r#"{"target_modules": ["q_proj"], "r": 0}"#, "`r`"),
            (
                r#"{"target_modules": ["q_proj"], "peft_type": "IA3"}"#,
                "peft_type",
            ),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(name), "{text}: {e}");
        }
    }
}
