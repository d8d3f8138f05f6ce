//! `y + a·bᵀ` and `y + a·b` written into y ([`add_matmul_t`], [`add_matmul`]): on a GPU one
//! cuBLAS GEMM with β = 1, where
//! the composition would write the product and then read it again to add it (the LoRA
//! update's second matmul and its sum with the base layer's output, forward and backward).

use candle_core::{DType, Result, Tensor};

/// `y + a·bᵀ` for y (m, n), a (m, k) and b (n, k), in y's dtype. On a GPU, with the three
/// contiguous in one dtype of F16, BF16 or F32, the product is accumulated into y's own
/// buffer by one GEMM (β = 1, F32 accumulation) and y is returned: y is consumed, and a
/// tensor that shares its storage (a clone, a view) sees the sum too, so the caller hands
/// over a y it alone holds (a fresh matmul's output). Elsewhere `y + a.matmul(bᵀ)`.
pub fn add_matmul_t(y: Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    add_product(y, a, b, true)
}

/// `y + a·b` for y (m, n), a (m, k) and b (k, n): [`add_matmul_t`] with b as it is.
pub fn add_matmul(y: Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    add_product(y, a, b, false)
}

/// `y + a·bᵀ` (`transposed`, b (n, k)) or `y + a·b` (b (k, n)).
fn add_product(y: Tensor, a: &Tensor, b: &Tensor, transposed: bool) -> Result<Tensor> {
    let (m, n) = y.dims2()?;
    let (ma, k) = a.dims2()?;
    let (b0, b1) = b.dims2()?;
    let (nb, kb) = if transposed { (b0, b1) } else { (b1, b0) };
    if ma != m || nb != n || kb != k {
        candle_core::bail!(
            "add_matmul: y {:?}, a {:?} and b {:?} do not make y + a·b{}",
            y.dims(),
            a.dims(),
            b.dims(),
            if transposed { "ᵀ" } else { "" }
        );
    }
    #[cfg(feature = "cuda")]
    if in_place_applies(&y, a, b) {
        y.inplace_op3(a, b, &cuda::AddProduct { transposed })?;
        return Ok(y);
    }
    let product = if transposed {
        a.matmul(&b.t()?)?
    } else {
        a.matmul(b)?
    };
    let dtype = y.dtype();
    y + product.to_dtype(dtype)?
}

/// Whether [`add_matmul_t`] runs as one GEMM into y.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn in_place_applies(y: &Tensor, a: &Tensor, b: &Tensor) -> bool {
    let dense = |t: &Tensor| t.is_contiguous() && t.elem_count() > 0;
    y.device().is_cuda()
        && y.device().same_device(a.device())
        && y.device().same_device(b.device())
        && matches!(y.dtype(), DType::F16 | DType::BF16 | DType::F32)
        && a.dtype() == y.dtype()
        && b.dtype() == y.dtype()
        && dense(y)
        && dense(a)
        && dense(b)
        && !y.layout().has_internal_overlap()
}

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cublas::CudaBlas;
    use candle_core::cuda_backend::cudarc::cublas::{
        sys::cublasOperation_t as Op, Gemm, GemmConfig,
    };
    use candle_core::cuda_backend::cudarc::driver::CudaSlice;
    use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice as S, WrapErr};
    use candle_core::{CpuStorage, InplaceOp3, Layout, Result};

    /// The GEMM of [`super::add_matmul_t`] (`transposed`) and [`super::add_matmul`].
    pub(super) struct AddProduct {
        pub(super) transposed: bool,
    }

    /// The element types the GEMM takes, with their 1.
    trait One: Copy {
        const ONE: Self;
    }
    impl One for f32 {
        const ONE: Self = 1.0;
    }
    impl One for half::f16 {
        const ONE: Self = half::f16::ONE;
    }
    impl One for half::bf16 {
        const ONE: Self = half::bf16::ONE;
    }

    fn to_i32(v: usize) -> Result<i32> {
        i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("add_matmul: {v} too large")))
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm<T: One>(
        transposed: bool,
        blas: &CudaBlas,
        y: &mut CudaSlice<T>,
        yl: &Layout,
        a: &CudaSlice<T>,
        al: &Layout,
        b: &CudaSlice<T>,
        bl: &Layout,
    ) -> Result<()>
    where
        CudaBlas: Gemm<T>,
    {
        let (m, n) = yl.shape().dims2()?;
        let (_, k) = al.shape().dims2()?;
        let span = |l: &Layout, what: &str| {
            l.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg(format!("add_matmul: {what} is not contiguous"))
            })
        };
        let (y0, y1) = span(yl, "y")?;
        let (a0, a1) = span(al, "a")?;
        let (b0, b1) = span(bl, "b")?;
        // Column-major, as cuBLAS reads: y (m × n, row-major) is n × m with leading dimension
        // n and a (m × k) is k × m, so yᵀ += op(b)·a. b (n × k, row-major: a·bᵀ) is k × n,
        // transposed (lda k); b (k × n: a·b) is n × k as it is (lda n).
        let cfg = GemmConfig {
            transa: if transposed {
                Op::CUBLAS_OP_T
            } else {
                Op::CUBLAS_OP_N
            },
            transb: Op::CUBLAS_OP_N,
            m: to_i32(n)?,
            n: to_i32(m)?,
            k: to_i32(k)?,
            alpha: T::ONE,
            lda: to_i32(if transposed { k } else { n })?,
            ldb: to_i32(k)?,
            beta: T::ONE,
            ldc: to_i32(n)?,
        };
        let mut c = y.slice_mut(y0..y1);
        // SAFETY: A is b's n·k elements, B is a's m·k, C is y's m·n (each range checked
        // contiguous by its layout, and of those sizes by the shapes `add_product` checked;
        // lda is b's row length in either form); C does not overlap A or B (Candle's in-place op refuses a source that
        // shares y's storage). All three are on the blas handle's stream (the device's),
        // which the slices' accesses order.
        unsafe { blas.gemm(cfg, &b.slice(b0..b1), &a.slice(a0..a1), &mut c) }.w()?;
        Ok(())
    }

    impl InplaceOp3 for AddProduct {
        fn name(&self) -> &'static str {
            "add-matmul"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<()> {
            candle_core::bail!("add_matmul: the in-place GEMM runs on a GPU only")
        }

        fn cuda_fwd(
            &self,
            y: &mut CudaStorage,
            yl: &Layout,
            a: &CudaStorage,
            al: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> Result<()> {
            let dev = y.device().clone();
            let blas = dev.cublas_handle();
            match (&mut y.slice, &a.slice, &b.slice) {
                (S::F32(y), S::F32(a), S::F32(b)) => {
                    gemm(self.transposed, &blas, y, yl, a, al, b, bl)
                }
                (S::F16(y), S::F16(a), S::F16(b)) => {
                    gemm(self.transposed, &blas, y, yl, a, al, b, bl)
                }
                (S::BF16(y), S::BF16(a), S::BF16(b)) => {
                    gemm(self.transposed, &blas, y, yl, a, al, b, bl)
                }
                _ => candle_core::bail!("add_matmul: y, a and b in one of F16, BF16, F32"),
            }
        }
    }
}
