//! Bring your own model: the application-defined decoder of `examples/own_model/` (its own
//! candle-nn code, not from the models crate) gives bit-identical logits offloaded under a
//! budget that streams its layers, and as a pipeline over two devices, to its own resident
//! forward pass; the glue is the example's `glue.rs`, compiled here unchanged.

use candle_core::Device;

#[path = "../examples/own_model/demo.rs"]
mod demo;
#[path = "../examples/own_model/glue.rs"]
mod glue;
#[path = "../examples/own_model/model.rs"]
#[allow(dead_code)]
mod model;

fn own_model_offloaded_and_sharded_equal_resident(device: &Device) -> anyhow::Result<()> {
    let c = model::TinyConfig {
        vocab: 300,
        hidden: 64,
        layers: 6,
        heads: 4,
        ffn: 160,
        max_len: 48,
    };
    let prompt: Vec<u32> = (0..9).map(|i| (i * 31 + 7) % 300).collect();
    // Two CPU "devices" share the CPU; on a GPU the pipeline needs a second GPU.
    let second = match device {
        Device::Cpu => Some(Device::Cpu),
        _ => Device::new_cuda_with_stream(1).ok(),
    };
    let r = demo::run(&c, device, second.as_ref(), &prompt, 12)?;
    assert_eq!(r.steps, 13);
    assert_eq!(r.offloaded_equal, r.steps, "offloaded logits differ");
    if second.is_some() {
        assert_eq!(r.sharded_equal, Some(r.steps), "two-device logits differ");
        assert_eq!(r.device_map.len(), 2);
        assert!(r.device_map.iter().all(|d| d.2 > 0), "{:?}", r.device_map);
    }
    assert!(
        r.layer_fetches > 2 * c.layers as u64,
        "the budget should stream layers: {} fetches",
        r.layer_fetches
    );
    assert!(r.peak_resident_bytes < r.budget_bytes);
    Ok(())
}

test_device!(
    own_model_offloaded_and_sharded_equal_resident,
    own_model_equal_resident_cpu,
    own_model_equal_resident_gpu
);
