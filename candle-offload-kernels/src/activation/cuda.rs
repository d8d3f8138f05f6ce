//! The CUDA launches of the activations (`kernels/activation.cu`): `silu_mul` for inference and
//! the training SwiGLU's forward and backward, elementwise grid-stride loops over contiguous
//! slices of one float dtype.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaStorage, Map2, WrapErr};
use candle_core::{CudaDevice, Layout, Result, WithDType};

use crate::cuda::{by_dtype, grid_stride, load, storage_view as view_t, view, Elem, ACTIVATION};

/// `silu_mul`: silu(gate) · up.
pub(crate) fn silu_mul(
    (g, gl): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    struct K;
    impl Map2 for K {
        fn f<T: DeviceRepr + WithDType + ValidAsZeroBits>(
            &self,
            g: &CudaSlice<T>,
            gl: &Layout,
            u: &CudaSlice<T>,
            ul: &Layout,
            dev: &CudaDevice,
        ) -> Result<CudaSlice<T>> {
            let func = load::<T>(dev, ACTIVATION, "silu_mul")?;
            let (g, u) = (view(g, gl, "gate")?, view(u, ul, "up")?);
            let n = g.len();
            if u.len() != n || n == 0 {
                candle_core::bail!("silu_mul: gate has {n} elements, up {}", u.len());
            }
            // SAFETY: uninitialised device memory of n elements on the device's stream; the
            // kernel launched next on that stream writes every one of them.
            let out = unsafe { dev.alloc::<T>(n) }?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&g);
            b.arg(&u);
            b.arg(&out);
            b.arg(&n);
            // SAFETY: the arguments match `silu_mul_<dtype>(const T*, const T*, T*, size_t)` in
            // kernels/activation.cu; gate, up and out hold n elements and the kernel's grid-stride
            // loop touches indices below n only.
            unsafe { b.launch(grid_stride(n, 1 << 20)) }.w()?;
            Ok(out)
        }
    }
    let dev = g.device();
    let slice = K.map(&g.slice, gl, &u.slice, ul, dev)?;
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// SwiGLU forward: silu(gate) · up.
pub(crate) fn swiglu_fwd(
    (a, al): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        a: &CudaStorage,
        al: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<CudaStorage> {
        let dev = &a.device;
        let func = load::<T>(dev, ACTIVATION, "swiglu_fwd")?;
        let (av, uv) = (view_t::<T>(a, al, "gate")?, view_t::<T>(u, ul, "up")?);
        let n = av.len();
        if uv.len() != n || n == 0 {
            candle_core::bail!("swiglu: gate has {n} elements, up {}", uv.len());
        }
        // SAFETY: uninitialised device memory of n elements on the device's stream; the
        // kernel launched next writes every one of them.
        let out = unsafe { dev.alloc::<T>(n) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&av).arg(&uv).arg(&out).arg(&n);
        // SAFETY: the arguments match `swiglu_fwd_<dtype>(const T*, const T*, T*, size_t)` in
        // kernels/activation.cu; all three buffers hold n elements and its grid-stride loop stays
        // below n.
        unsafe { b.launch(grid_stride(n, 1 << 16)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!("swiglu", a.dtype(), run(a, al, u, ul))
}

/// SwiGLU backward: one buffer of 2n, d gate then d up.
pub(crate) fn swiglu_bwd(
    (a, al): (&CudaStorage, &Layout),
    (u, ul): (&CudaStorage, &Layout),
    (g, gl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    fn run<T: Elem>(
        (a, al): (&CudaStorage, &Layout),
        (u, ul): (&CudaStorage, &Layout),
        (g, gl): (&CudaStorage, &Layout),
    ) -> Result<CudaStorage> {
        let dev = &a.device;
        let func = load::<T>(dev, ACTIVATION, "swiglu_bwd")?;
        let (av, uv, gv) = (
            view_t::<T>(a, al, "gate")?,
            view_t::<T>(u, ul, "up")?,
            view_t::<T>(g, gl, "gradient")?,
        );
        let n = av.len();
        if uv.len() != n || gv.len() != n || n == 0 {
            candle_core::bail!(
                "swiglu backward: buffers of {n}, {} and {}",
                uv.len(),
                gv.len()
            );
        }
        // SAFETY: uninitialised device memory of 2n elements on the device's stream; the
        // kernel launched next writes every one (i and n + i for each i < n).
        let out = unsafe { dev.alloc::<T>(2 * n) }?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        b.arg(&av).arg(&uv).arg(&gv).arg(&out).arg(&n);
        // SAFETY: the arguments match `swiglu_bwd_<dtype>(const T*, const T*, const T*, T*,
        // size_t)` in kernels/activation.cu; gate, up and g hold n elements and out 2n, and its
        // grid-stride loop stays below n.
        unsafe { b.launch(grid_stride(n, 1 << 16)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    by_dtype!("swiglu backward", a.dtype(), run((a, al), (u, ul), (g, gl)))
}
