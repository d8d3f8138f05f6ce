//! LoRA adapters on a model's frozen linear layers: which modules they sit on and at what rank
//! and scale ([`LoraConfig`]), the adapters themselves by module path ([`Adapters`]), PEFT's
//! files ([`peft`]: `adapter_config.json` and `adapter_model.safetensors`, both ways) and
//! folding an adapter into its base weights ([`merge`]).
//!
//! A block's layers get their adapter where they are built: [`crate::UnitWeights::linear`]
//! looks the module's path up in the [`Adapters`] the weights carry
//! ([`crate::UnitWeights::with_adapters`]) and hands the layer
//! [`Linear::with_adapter`](crate::layers::Linear::with_adapter). No family changes.

pub mod merge;
pub mod peft;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::config::Config;
use crate::layers::LoraAdapter;

/// The modules adapted by default: every projection of attention and MLP, under the names of
/// the HF checkpoints (Phi-3's fused `qkv_proj` and `gate_up_proj` included).
pub const DEFAULT_TARGETS: [&str; 9] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
];

/// The short names `--lora-targets` takes besides the module names themselves.
pub fn target_alias(name: &str) -> Vec<&'static str> {
    match name {
        "q" => vec!["q_proj"],
        "k" => vec!["k_proj"],
        "v" => vec!["v_proj"],
        "o" => vec!["o_proj"],
        "qkv" => vec!["qkv_proj"],
        "gate" => vec!["gate_proj"],
        "up" => vec!["up_proj"],
        "down" => vec!["down_proj"],
        "gate_up" => vec!["gate_up_proj"],
        "all" => DEFAULT_TARGETS.to_vec(),
        _ => Vec::new(),
    }
}

/// The rank, scale, dropout and target modules of a set of adapters, as PEFT's
/// `adapter_config.json` gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The rank r.
    pub r: usize,
    /// alpha: the update is scaled by alpha / r (alpha / √r with `use_rslora`).
    pub alpha: f64,
    /// Dropout on the adapters' input while training.
    pub dropout: f32,
    /// Module names (the last components of a module's path, `q_proj`) or whole paths
    /// (`model.layers.0.self_attn.q_proj`).
    pub target_modules: Vec<String>,
    /// Scale by alpha / √r.
    pub use_rslora: bool,
    /// Ranks of the modules a key matches (a module name or path suffix).
    pub rank_pattern: BTreeMap<String, usize>,
    /// alphas of the modules a key matches.
    pub alpha_pattern: BTreeMap<String, f64>,
    /// The base model, as recorded in the file.
    pub base_model_name_or_path: Option<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: DEFAULT_TARGETS.iter().map(|s| s.to_string()).collect(),
            use_rslora: false,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            base_model_name_or_path: None,
        }
    }
}

/// Whether `key` names the module at `path`: the whole path, or its last components.
fn matches(path: &str, key: &str) -> bool {
    path == key || path.ends_with(&format!(".{key}"))
}

impl LoraConfig {
    /// Whether the module at `path` is adapted.
    pub fn targets(&self, path: &str) -> bool {
        self.target_modules.iter().any(|t| matches(path, t))
    }

    /// The rank of the module at `path` (`rank_pattern`'s where a key matches; the longest
    /// matching key wins).
    pub fn rank_of(&self, path: &str) -> usize {
        longest(&self.rank_pattern, path).copied().unwrap_or(self.r)
    }

    /// The alpha of the module at `path`.
    pub fn alpha_of(&self, path: &str) -> f64 {
        longest(&self.alpha_pattern, path)
            .copied()
            .unwrap_or(self.alpha)
    }

    /// The scale of the module at `path`: alpha / r, or alpha / √r with `use_rslora`.
    pub fn scale_of(&self, path: &str) -> f64 {
        let (r, alpha) = (self.rank_of(path) as f64, self.alpha_of(path));
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }

    /// The linear modules of a model of `cfg` this config adapts: path, (in, out). Only the
    /// decoder layers' projections can be adapted; targets that match none of them are an
    /// error naming them (as PEFT refuses them), while one of several that matches nothing is
    /// passed over (the defaults name both Phi-3's fused projections and the separate ones).
    pub fn modules(
        &self,
        cfg: &Config,
    ) -> std::result::Result<Vec<(String, usize, usize)>, String> {
        let layout = cfg.layout();
        let linear: Vec<(String, usize, usize)> = cfg
            .expected_tensors()
            .into_iter()
            .filter_map(|(name, shape)| {
                let path = name.strip_suffix(".weight")?;
                (shape.len() == 2 && path.starts_with(&layout.layer_prefix))
                    .then(|| (path.to_string(), shape[1], shape[0]))
            })
            .collect();
        if !linear.iter().any(|(p, _, _)| self.targets(p)) {
            return Err(format!(
                "target modules {:?} match no linear layer of the decoder (its layers' modules \
                 are named like {:?})",
                self.target_modules,
                linear.first().map(|(p, _, _)| p.as_str()).unwrap_or("")
            ));
        }
        Ok(linear
            .into_iter()
            .filter(|(p, _, _)| self.targets(p))
            .collect())
    }

    /// The module names (last path components) of the modules adapted in a model of `cfg`,
    /// sorted: what `target_modules` records in a saved file.
    pub fn module_names(&self, cfg: &Config) -> std::result::Result<Vec<String>, String> {
        let mut names: Vec<String> = self
            .modules(cfg)?
            .iter()
            .map(|(p, _, _)| p.rsplit('.').next().unwrap_or(p).to_string())
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }
}

fn longest<'a, T>(map: &'a BTreeMap<String, T>, path: &str) -> Option<&'a T> {
    map.iter()
        .filter(|(k, _)| matches(path, k))
        .max_by_key(|(k, _)| k.len())
        .map(|(_, v)| v)
}

/// One module's adapter: A (r, in) and B (out, r), as variables where they are trained.
#[derive(Debug, Clone)]
pub struct ModuleAdapter {
    /// A (r, in).
    pub a: Var,
    /// B (out, r).
    pub b: Var,
    /// The layer's adapter over `a` and `b`, with its scale and dropout.
    pub adapter: Arc<LoraAdapter>,
}

/// The adapters of a model, by module path (`model.layers.0.self_attn.q_proj`), with the
/// config they were made with.
#[derive(Debug, Clone)]
pub struct Adapters {
    config: LoraConfig,
    modules: BTreeMap<String, ModuleAdapter>,
}

impl Adapters {
    /// Adapters of `a` and `b` by module path, in F32 on `device`, scaled as `config` says;
    /// new variables (copies), whatever `a` and `b` are.
    pub fn from_tensors(
        config: LoraConfig,
        tensors: BTreeMap<String, (Tensor, Tensor)>,
        device: &Device,
    ) -> Result<Self> {
        let mut modules = BTreeMap::new();
        for (path, (a, b)) in tensors {
            // Detached first: a variable given here is copied, never shared with the caller's.
            let a = Var::from_tensor(&a.detach().to_dtype(DType::F32)?.to_device(device)?)?;
            let b = Var::from_tensor(&b.detach().to_dtype(DType::F32)?.to_device(device)?)?;
            let adapter = Arc::new(LoraAdapter::new(
                a.as_tensor().clone(),
                b.as_tensor().clone(),
                config.scale_of(&path),
                config.dropout,
            )?);
            modules.insert(path, ModuleAdapter { a, b, adapter });
        }
        Ok(Self { config, modules })
    }

    /// New adapters for the modules `config` targets in a model of `cfg`, initialised as PEFT
    /// does by default: A uniform in ±1/√in (Kaiming-uniform with a = √5), B zero, so that the
    /// model starts as the base. `seed` makes A reproducible.
    pub fn init(
        config: LoraConfig,
        cfg: &Config,
        device: &Device,
        seed: u64,
    ) -> std::result::Result<Self, String> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            // xorshift64*: a reproducible stream independent of the device's generator.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let v = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (v >> 40) as f32 / (1u64 << 24) as f32
        };
        let mut tensors = BTreeMap::new();
        for (path, inp, out) in config.modules(cfg)? {
            let r = config.rank_of(&path);
            let bound = 1.0 / (inp as f32).sqrt();
            let a: Vec<f32> = (0..r * inp).map(|_| (next() * 2.0 - 1.0) * bound).collect();
            let a = Tensor::from_vec(a, (r, inp), &Device::Cpu).map_err(|e| e.to_string())?;
            let b = Tensor::zeros((out, r), DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
            tensors.insert(path, (a, b));
        }
        Self::from_tensors(config, tensors, device).map_err(|e| e.to_string())
    }

    /// The config.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// Drops every adapter's detached copies ([`LoraAdapter::forget_casts`]): before a pass
    /// that follows an optimizer step.
    pub fn forget_casts(&self) {
        for m in self.modules.values() {
            m.adapter.forget_casts();
        }
    }

    /// The adapter of the module at `path`.
    pub fn get(&self, path: &str) -> Option<&Arc<LoraAdapter>> {
        self.modules.get(path).map(|m| &m.adapter)
    }

    /// Every module's adapter, by path.
    pub fn modules(&self) -> &BTreeMap<String, ModuleAdapter> {
        &self.modules
    }

    /// The trainable variables (each module's A then B), by PEFT's key names.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (path, m) in &self.modules {
            out.push((peft::key(path, "lora_A"), m.a.clone()));
            out.push((peft::key(path, "lora_B"), m.b.clone()));
        }
        out
    }

    /// Number of trainable parameters.
    pub fn parameter_count(&self) -> usize {
        self.modules
            .values()
            .map(|m| m.a.elem_count() + m.b.elem_count())
            .sum()
    }

    /// FLOPs of one token's forward pass through every adapter: 2·r·(in + out) per module.
    pub fn forward_flops_per_token(&self) -> u64 {
        self.modules
            .values()
            .map(|m| {
                let (inp, out) = m.adapter.dims();
                2 * (m.adapter.rank() * (inp + out)) as u64
            })
            .sum()
    }

    /// Checks every module against a model of `cfg`: the path is one of its linear layers and
    /// A and B have its widths; errors name the module.
    pub fn check(&self, cfg: &Config) -> std::result::Result<(), String> {
        let layout = cfg.layout();
        let shapes: HashMap<String, Vec<usize>> = cfg
            .expected_tensors()
            .into_iter()
            .filter(|(n, _)| n.starts_with(&layout.layer_prefix))
            .collect();
        for (path, m) in &self.modules {
            let Some(shape) = shapes.get(&format!("{path}.weight")) else {
                return Err(format!("{path}: no such linear layer in the model"));
            };
            let (inp, out) = m.adapter.dims();
            if shape.as_slice() != [out, inp] {
                return Err(format!(
                    "{path}: adapter is {out}x{inp} (lora_B rows x lora_A columns), the layer's \
                     weight is {shape:?}"
                ));
            }
        }
        Ok(())
    }
}
