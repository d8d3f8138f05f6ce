//! Causal attention of a prompt's pass over a KV cache as one FlashAttention-2 kernel
//! ([`prompt_attention`]), reading k and v from the cache's strided views.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use crate::attention::decode::decode_attention_unfused;
use crate::attention::dims::AttentionDims;
use crate::attention::flash::FLASH_GPU_HEAD_DIMS;
use crate::tuning::KernelTuning;
use crate::util::check_dtypes;

/// Whether [`prompt_attention`] runs its kernel for inputs of `dtype` with head width `d` on
/// `device`: [`KernelTuning::prompt_attention`], a GPU of a build with CUDA, F16 or BF16, and a width the
/// flash-attention kernels exist for ([`FLASH_GPU_HEAD_DIMS`]);
/// elsewhere it computes the composition.
pub fn prompt_attention_supported(
    device: &candle_core::Device,
    dtype: DType,
    d: usize,
    tuning: &KernelTuning,
) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && tuning.prompt_attention
        && matches!(dtype, DType::F16 | DType::BF16)
        && FLASH_GPU_HEAD_DIMS.contains(&d)
}

/// A prompt pass's attention as one kernel.
#[derive(Debug)]
struct PromptAttention {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scale: f32,
}

impl PromptAttention {
    const NAME: &'static str = "prompt-attention";
}

impl candle_core::CustomOp3 for PromptAttention {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // prompt_attention computes the composition on the CPU instead.
        candle_core::bail!("{}: no CPU kernel", Self::NAME)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = AttentionDims::of_op(Self::NAME, l1, l2, l3)?;
        let out = crate::attention::flash_cuda::prompt_attn_fwd(
            [dims.b, dims.hq, dims.hk, dims.tq, dims.d],
            dims.kv_len,
            self.scale,
            (s1, l1),
            (s2, l2),
            (s3, l3),
        )?;
        Ok((out, Shape::from((dims.b, dims.hq, dims.tq, dims.d))))
    }
}

/// Causal attention of a prompt's pass, `q` (batch, q_heads, new, head_dim), over the first
/// positions of a KV cache `k`, `v` (batch, kv_heads, cached, head_dim), the new positions
/// being the last `new` of the `cached` ones: what [`decode_attention`](crate::attention::decode_attention) computes, for passes
/// of many rows. Returns (batch, new, q_heads, head_dim).
///
/// Where [`prompt_attention_supported`], one FlashAttention-2 kernel (the training forward of
/// [`crate::attention::flash_attention`], on tensor cores, F32 scores and sums, the probabilities
/// rounded to the inputs' dtype for their product with v) reads k and v from the cache's
/// strided views: no F32 copies of q, k and v, no (new, cached) score matrix, no mask or
/// softmax launches. `k` and `v` must then be views of a cache's buffers (rows contiguous,
/// heads evenly apart, as [`crate::rope::rope_qk_cache`] writes them). Elsewhere it computes
/// [`decode_attention_unfused`] (no window), the composition it replaces.
pub fn prompt_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    tuning: &KernelTuning,
) -> Result<Tensor> {
    let op = PromptAttention::NAME;
    let dtype = check_dtypes(op, &[q, k, v])?;
    let dims = AttentionDims::of_op(op, q.layout(), k.layout(), v.layout())?;
    if dims.out_len() == 0 || !prompt_attention_supported(q.device(), dtype, dims.d, tuning) {
        return decode_attention_unfused(q, k, v, scale, None);
    }
    let op = PromptAttention {
        scale: scale as f32,
    };
    // `contiguous` copies q only where it is not (the kernel reads it row-major).
    q.contiguous()?.apply_op3_no_bwd(k, v, &op)?.transpose(1, 2)
}
