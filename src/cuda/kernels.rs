//! The decode kernels of `kernels/decode.cu`, loaded from their checked-in PTX
//! (`kernels/decode.ptx`, produced by `scripts/gen-ptx.py` with NVRTC) with
//! `cuModuleLoadData`: the driver compiles the PTX for the GPU it finds, and building needs no
//! CUDA toolkit. They run over the flat per-layer K/V views of the step API
//! ([`KvView`](crate::kv::KvView)).

use std::ffi::{c_void, CString};
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, CudaDevice};
use super::stream::CudaStream;
use crate::api::MemoryError;
use crate::kv::{KvDtype, RowLayout};

/// The PTX the kernels are loaded from.
pub const DECODE_PTX: &str = include_str!("../../kernels/decode.ptx");

/// Tokens in one split of the context on the GPU (one block per split and KV head).
pub const CUDA_SPLIT_TOKENS: u32 = 128;

/// The largest head the kernels take (eight elements per lane of a warp).
pub const CUDA_MAX_HEAD_DIM: u32 = 256;

/// One decode step for one layer, as the kernels take it: device addresses and the shape.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLaunch {
    /// `q_heads × head_dim` `f32`.
    pub q: u64,
    /// The layer's K view: `tokens` rows of `kv_heads × head_dim` elements.
    pub k: u64,
    /// The layer's V view, laid out as K.
    pub v: u64,
    /// The element type of K.
    pub k_dtype: KvDtype,
    /// The element type of V.
    pub v_dtype: KvDtype,
    /// How K's rows lie (its view's [`KvView::rows`](crate::kv::KvView::rows)): dense for
    /// `f32` and `f16`, grouped in pages for some `q8_0` rows.
    pub k_rows: RowLayout,
    /// How V's rows lie.
    pub v_rows: RowLayout,
    /// Rows to attend over.
    pub tokens: u32,
    /// Query heads.
    pub q_heads: u32,
    /// KV heads (dividing `q_heads`, at most 32 query heads per KV head).
    pub kv_heads: u32,
    /// Elements per head (at most [`CUDA_MAX_HEAD_DIM`]).
    pub head_dim: u32,
    /// Scratch of [`DecodeLaunch::partials_bytes`] bytes.
    pub partials: u64,
    /// `q_heads × head_dim` `f32` receiving the output.
    pub out: u64,
}

impl DecodeLaunch {
    /// Splits of the context.
    pub fn splits(&self) -> u32 {
        self.tokens.div_ceil(CUDA_SPLIT_TOKENS)
    }

    /// Bytes of scratch the partial results need (`u64::MAX` for a shape no device holds:
    /// allocating it then fails instead of the size wrapping).
    pub fn partials_bytes(&self) -> u64 {
        u64::from(self.splits())
            .saturating_mul(u64::from(self.q_heads))
            .saturating_mul(u64::from(self.head_dim) + 2)
            .saturating_mul(4)
    }

    fn validate(&self) -> Result<(), MemoryError> {
        let bad = |why: &str| {
            Err(MemoryError::Driver {
                op: "decode launch",
                code: why.to_string(),
            })
        };
        if self.kv_heads == 0 || self.q_heads % self.kv_heads != 0 {
            return bad("kv_heads must divide q_heads");
        }
        if self.q_heads / self.kv_heads > 32 {
            return bad("at most 32 query heads per KV head");
        }
        if self.head_dim == 0 || self.head_dim > CUDA_MAX_HEAD_DIM {
            return bad("head_dim must be 1..=256");
        }
        let block = self.k_dtype.block_values().max(self.v_dtype.block_values());
        if self.head_dim as usize % block != 0 {
            return bad("a q8_0 head is whole blocks of 32");
        }
        let values = self.kv_heads as usize * self.head_dim as usize;
        for (dtype, rows) in [(self.k_dtype, self.k_rows), (self.v_dtype, self.v_rows)] {
            let fits = dtype.row_bytes(values) == Some(rows.row_bytes)
                && (rows.is_dense()
                    || dtype == KvDtype::Q8_0
                        && rows.group_rows >= 1
                        && rows
                            .group_rows
                            .checked_mul(rows.row_bytes)
                            .is_some_and(|b| b <= rows.group_bytes));
            if !fits {
                return bad("the rows' layout does not fit their type and heads");
            }
        }
        if self.tokens == 0 {
            return bad("no tokens to attend over");
        }
        Ok(())
    }
}

/// The loaded module and its functions, for one device.
pub struct DecodeKernels {
    device: Arc<CudaDevice>,
    module: sys::CUmodule,
    /// `gqa_split_<k>_<v>`, by K's then V's index in [`KvDtype::ALL`].
    split: [[sys::CUfunction; 3]; 3],
    merge: sys::CUfunction,
    write_f32: sys::CUfunction,
    write_f16: sys::CUfunction,
    write_q8_0: sys::CUfunction,
}

// SAFETY: module and function handles are driver objects usable from any thread with their
// context current (every use binds it first); nothing here is thread-local.
unsafe impl Send for DecodeKernels {}
// SAFETY: as above; launching through a shared reference mutates nothing of ours.
unsafe impl Sync for DecodeKernels {}

impl std::fmt::Debug for DecodeKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeKernels")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl DecodeKernels {
    /// Loads the PTX on `device` (`cuModuleLoadData`) and looks up every kernel.
    pub fn load(device: Arc<CudaDevice>) -> Result<Self, MemoryError> {
        device.bind()?;
        let image = CString::new(DECODE_PTX).expect("PTX text has no NUL");
        let mut module = MaybeUninit::uninit();
        // SAFETY: the context is current; `image` is a NUL-terminated PTX image that outlives
        // the call; `module` is a valid out-pointer.
        check("cuModuleLoadData", 0, unsafe {
            sys::cuModuleLoadData(module.as_mut_ptr(), image.as_ptr().cast())
        })?;
        // SAFETY: the load succeeded, so the handle was written.
        let module = unsafe { module.assume_init() };
        let function = |name: &str| -> Result<sys::CUfunction, MemoryError> {
            let name = CString::new(name).expect("kernel names have no NUL");
            let mut f = MaybeUninit::uninit();
            // SAFETY: `module` is loaded; `name` is NUL-terminated; `f` is an out-pointer.
            check("cuModuleGetFunction", 0, unsafe {
                sys::cuModuleGetFunction(f.as_mut_ptr(), module, name.as_ptr())
            })?;
            // SAFETY: the lookup succeeded, so the handle was written.
            Ok(unsafe { f.assume_init() })
        };
        let found = (|| {
            let mut split = [[std::ptr::null_mut(); 3]; 3];
            for (k, row) in KvDtype::ALL.iter().zip(split.iter_mut()) {
                for (v, f) in KvDtype::ALL.iter().zip(row.iter_mut()) {
                    *f = function(&format!("gqa_split_{k}_{v}"))?;
                }
            }
            Ok::<_, MemoryError>((
                split,
                function("gqa_merge")?,
                function("kv_write_f32")?,
                function("kv_write_f16")?,
                function("kv_write_q8_0")?,
            ))
        })();
        match found {
            Ok((split, merge, write_f32, write_f16, write_q8_0)) => Ok(DecodeKernels {
                device,
                module,
                split,
                merge,
                write_f32,
                write_f16,
                write_q8_0,
            }),
            Err(e) => {
                // SAFETY: loaded above, no function of it was handed out.
                let _ = unsafe { sys::cuModuleUnload(module) };
                Err(e)
            }
        }
    }

    /// Queues one decode step on `stream`: the splits' partial softmaxes, then their merge
    /// into `launch.out`.
    ///
    /// # Safety
    /// Every address in `launch` is device memory of this device, mapped read-write for as
    /// long as the work runs on `stream` (until a fence recorded after it completes), and
    /// holds what [`DecodeLaunch`] says; `partials` and `out` are not read or written by
    /// other work meanwhile.
    pub unsafe fn decode(
        &self,
        stream: &CudaStream,
        launch: &DecodeLaunch,
    ) -> Result<(), MemoryError> {
        launch.validate()?;
        let splits = launch.splits();
        let group = launch.q_heads / launch.kv_heads;
        let scale = 1.0f32 / (launch.head_dim as f32).sqrt();
        let split_tokens = CUDA_SPLIT_TOKENS;
        let mut args: [*mut c_void; 14] = [
            &launch.q as *const u64 as *mut c_void,
            &launch.k as *const u64 as *mut c_void,
            &launch.v as *const u64 as *mut c_void,
            &launch.tokens as *const u32 as *mut c_void,
            &split_tokens as *const u32 as *mut c_void,
            &launch.q_heads as *const u32 as *mut c_void,
            &launch.kv_heads as *const u32 as *mut c_void,
            &launch.head_dim as *const u32 as *mut c_void,
            &scale as *const f32 as *mut c_void,
            &launch.partials as *const u64 as *mut c_void,
            &launch.k_rows.group_rows as *const u64 as *mut c_void,
            &launch.k_rows.group_bytes as *const u64 as *mut c_void,
            &launch.v_rows.group_rows as *const u64 as *mut c_void,
            &launch.v_rows.group_bytes as *const u64 as *mut c_void,
        ];
        let index = |d: KvDtype| KvDtype::ALL.iter().position(|x| *x == d).unwrap_or(0);
        let split = self.split[index(launch.k_dtype)][index(launch.v_dtype)];
        // SAFETY: the caller's contract covers the memory; the argument array matches the
        // kernel's parameters in order and type, and lives across the call (the driver
        // copies the values when it queues the launch).
        unsafe {
            self.launch(
                split,
                stream,
                (splits, launch.kv_heads),
                32 * group,
                &mut args,
            )?
        };
        let mut merge_args: [*mut c_void; 5] = [
            &launch.partials as *const u64 as *mut c_void,
            &splits as *const u32 as *mut c_void,
            &launch.q_heads as *const u32 as *mut c_void,
            &launch.head_dim as *const u32 as *mut c_void,
            &launch.out as *const u64 as *mut c_void,
        ];
        // SAFETY: as above, for the merge kernel's parameters.
        unsafe {
            self.launch(
                self.merge,
                stream,
                (launch.q_heads, 1),
                launch.head_dim.min(256),
                &mut merge_args,
            )
        }
    }

    /// Queues a write of one token's row: `n` `f32`s at `src` converted to `dtype` at `dst`
    /// (a [`KvView::row_addr`](crate::kv::KvView::row_addr)); `q8_0` quantizes whole blocks
    /// of 32 (`n` a multiple of 32, refused otherwise).
    ///
    /// # Safety
    /// `dst` holds `n` elements of `dtype` and `src` `n` `f32`s of this device, both mapped
    /// (`dst` read-write) until the work on `stream` completes, and nothing else writes `dst`
    /// meanwhile.
    pub unsafe fn write_row(
        &self,
        stream: &CudaStream,
        dtype: KvDtype,
        dst: u64,
        src: u64,
        n: u32,
    ) -> Result<(), MemoryError> {
        if n == 0 {
            return Ok(());
        }
        let f = match dtype {
            KvDtype::F32 => self.write_f32,
            KvDtype::F16 => self.write_f16,
            KvDtype::Q8_0 if n % 32 == 0 => self.write_q8_0,
            KvDtype::Q8_0 => {
                return Err(MemoryError::Driver {
                    op: "kv_write_q8_0",
                    code: "a q8_0 row is whole blocks of 32".into(),
                })
            }
        };
        let mut args: [*mut c_void; 3] = [
            &dst as *const u64 as *mut c_void,
            &src as *const u64 as *mut c_void,
            &n as *const u32 as *mut c_void,
        ];
        // SAFETY: the caller's contract; the arguments match `kv_write_*`'s parameters.
        unsafe { self.launch(f, stream, (n.div_ceil(256), 1), 256, &mut args) }
    }

    /// # Safety
    /// `args` matches `f`'s parameters; the memory they name is the caller's to use on
    /// `stream`.
    unsafe fn launch(
        &self,
        f: sys::CUfunction,
        stream: &CudaStream,
        grid: (u32, u32),
        block: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), MemoryError> {
        if !Arc::ptr_eq(&self.device, stream.device()) {
            return Err(MemoryError::Driver {
                op: "cuLaunchKernel",
                code: "the stream is on another device than the kernels".into(),
            });
        }
        self.device.bind()?;
        // SAFETY: the caller's contract; the module is loaded for as long as `self` lives.
        check("cuLaunchKernel", 0, unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                1,
                block,
                1,
                1,
                0,
                stream.raw(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for DecodeKernels {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // Work queued with these kernels may still run: wait for the context's work
            // before the code goes away.
            // SAFETY: the context is current.
            let _ = unsafe { sys::cuCtxSynchronize() };
            // SAFETY: loaded in `load`; nothing of it runs any more.
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(tokens: u32, q_heads: u32, kv_heads: u32, head_dim: u32) -> DecodeLaunch {
        let row = (kv_heads as usize).saturating_mul(head_dim as usize);
        DecodeLaunch {
            q: 0,
            k: 0,
            v: 0,
            k_dtype: KvDtype::F16,
            v_dtype: KvDtype::F16,
            k_rows: RowLayout::dense(KvDtype::F16.row_bytes(row).unwrap_or(u64::MAX)),
            v_rows: RowLayout::dense(KvDtype::F16.row_bytes(row).unwrap_or(u64::MAX)),
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            partials: 0,
            out: 0,
        }
    }

    #[test]
    fn sizes_at_the_limits_saturate_and_bad_shapes_are_refused() {
        let huge = launch(u32::MAX, u32::MAX, 1, u32::MAX);
        assert_eq!(huge.partials_bytes(), u64::MAX);
        assert_eq!(huge.splits(), u32::MAX.div_ceil(CUDA_SPLIT_TOKENS));
        let ok = launch(4096, 32, 8, 128);
        assert_eq!(ok.partials_bytes(), 32 * 32 * 130 * 4);
        assert!(ok.validate().is_ok());
        for bad in [
            launch(0, 32, 8, 128),  // nothing to attend over
            launch(16, 32, 0, 128), // no KV head
            launch(16, 30, 8, 128), // 8 does not divide 30
            launch(16, 64, 1, 128), // 64 query heads on one KV head: a 2,048-thread block
            launch(16, 32, 8, 0),   // empty heads
            launch(16, 32, 8, 257), // more than a warp's eight elements per lane
            launch(u32::MAX, u32::MAX, u32::MAX, u32::MAX),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let q8 = |head_dim: u32| DecodeLaunch {
            v_dtype: KvDtype::Q8_0,
            v_rows: RowLayout::of(KvDtype::Q8_0, u64::from(head_dim) * 3 / 32 * 34),
            ..launch(16, 9, 3, head_dim)
        };
        assert!(q8(64).validate().is_ok());
        assert_eq!(q8(64).v_rows.group_rows, 20, "204-byte rows, 20 to a page");
        assert!(
            q8(48).validate().is_err(),
            "a head of 48 is not whole blocks"
        );
        // A layout that is not the rows': refused before anything is queued.
        for rows in [
            RowLayout::dense(200),
            RowLayout {
                row_bytes: 204,
                group_rows: 21,
                group_bytes: 4096,
            },
        ] {
            let wrong = DecodeLaunch {
                v_rows: rows,
                ..q8(64)
            };
            assert!(wrong.validate().is_err(), "{rows:?}");
        }
        let grouped_f16 = DecodeLaunch {
            k_rows: RowLayout {
                group_rows: 10,
                group_bytes: 4096,
                ..launch(16, 9, 3, 64).k_rows
            },
            ..launch(16, 9, 3, 64)
        };
        assert!(grouped_f16.validate().is_err(), "f16 rows are dense");
    }
}
