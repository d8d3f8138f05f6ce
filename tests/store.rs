//! Loading the host store from safetensors: shards, dtype conversion, and bad files.

use std::path::Path;

use crate::util::scratch;
use candle_core::{DType, Device, Tensor};
use candle_offload::{store::safetensors_in_dir, HostStore, StoreConfig};

fn write_model(dir: &Path) -> anyhow::Result<Vec<(String, Tensor)>> {
    let weights = crate::util::mlp_weights(3, 16)?;
    let (a, b) = weights.split_at(3);
    let map = |ws: &[(String, Tensor)]| {
        ws.iter()
            .cloned()
            .collect::<std::collections::HashMap<_, _>>()
    };
    candle_core::safetensors::save(&map(a), dir.join("model-00001-of-00002.safetensors"))?;
    candle_core::safetensors::save(&map(b), dir.join("model-00002-of-00002.safetensors"))?;
    let mut index = serde_json::Map::new();
    for (n, _) in a {
        index.insert(n.clone(), "model-00001-of-00002.safetensors".into());
    }
    for (n, _) in b {
        index.insert(n.clone(), "model-00002-of-00002.safetensors".into());
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": index }).to_string(),
    )?;
    Ok(weights)
}

#[test]
fn sharded_safetensors_load_and_convert() -> anyhow::Result<()> {
    let dir = scratch("shards");
    let weights = write_model(&dir)?;
    let files = safetensors_in_dir(&dir)?;
    assert_eq!(files.len(), 2);
    let store = HostStore::from_safetensors(
        &files,
        &StoreConfig {
            dtype: Some(DType::BF16),
            ..Default::default()
        },
        &Device::Cpu,
    )?;
    assert_eq!(store.units().len(), 4, "embed + 3 layers");
    for (name, t) in &weights {
        let (u, meta) = store.tensor(name).unwrap();
        assert_eq!(meta.dtype, DType::BF16);
        let back = store.unit(u).cpu_tensor(meta)?.to_dtype(DType::F32)?;
        let want = t.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
        assert_eq!(
            back.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
            "{name}"
        );
    }
    Ok(())
}

#[test]
fn bad_files_are_clear_errors_naming_the_file() -> anyhow::Result<()> {
    let dir = scratch("bad");
    write_model(&dir)?;
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard)?;
    std::fs::write(&shard, &bytes[..bytes.len() / 2])?;
    let cfg = StoreConfig::default();
    let err = HostStore::from_safetensors(&[&shard], &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");

    let missing = dir.join("nope.safetensors");
    let err = HostStore::from_safetensors(&[&missing], &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope.safetensors") && err.contains("cannot open"),
        "{err}"
    );

    let not_st = dir.join("garbage.safetensors");
    std::fs::write(&not_st, b"this is not a safetensors file")?;
    let err = HostStore::from_safetensors(&[&not_st], &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("garbage.safetensors") && err.contains("not a valid safetensors"),
        "{err}"
    );

    std::fs::write(dir.join("model.safetensors.index.json"), "{ no json")?;
    let err = safetensors_in_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("model.safetensors.index.json"), "{err}");
    Ok(())
}
