//! The `cuda` section of `kv_decode`: the CUDA decode kernels (`kernels/decode.cu`) over KV
//! kept three ways on one GPU, in one run, at an 8B-like attention shape:
//!
//! - `virtual`: K and V per layer in `VirtualBuffer`s on CUDA VMM, grown a chunk at a time as
//!   tokens arrive (this project);
//! - `preallocated`: one `cuMemAlloc` of the maximum length per buffer;
//! - `staging_copy`: fixed-size pages gathered with device-to-device copies into a contiguous
//!   staging buffer before every attention.
//!
//! Each step writes the new token's K/V row with the copy kernel and runs the decode on every
//! layer; rounds are interleaved and timed to the stream's completion. `d2d_copy_gb_s` is a
//! `cuMemcpyDtoD` of as many bytes as the KV (bytes read plus bytes written per second), the
//! device's own copy speed to compare the kernel's KV read speed with.

use std::sync::Arc;
use std::time::Instant;

use procmem::cuda::{
    driver_present, CudaDevice, CudaMechanism, CudaStream, CudaVmmBacking, DecodeKernels,
    DecodeLaunch,
};
use procmem::kv::{KvDtype, RowLayout};
use procmem::{MemoryRole, VirtualBacking, VirtualBuffer};
use serde_json::json;

const LAYERS: usize = 2;
const Q_HEADS: u32 = 32;
const KV_HEADS: u32 = 8;
const HEAD_DIM: u32 = 128;
const ROW: u64 = (KV_HEADS * HEAD_DIM) as u64 * 4;
const CONTEXTS: [u64; 3] = [4096, 16384, 65536];
const STEPS_PER_ROUND: usize = 8;
const ROUNDS: usize = 5;
const PAGE_TOKENS: u64 = 16;

trait Kv {
    /// The K and V addresses of `layer` as the kernel reads them, after whatever the strategy
    /// does to present them (for `staging_copy`, the gather).
    fn prepare(&mut self, stream: &CudaStream, layer: usize, tokens: u64) -> (u64, u64);
    /// Where the new token's K and V rows of `layer` go (growing first where needed).
    fn row(&mut self, layer: usize, pos: u64) -> (u64, u64);
}

struct Virtual {
    bufs: Vec<(VirtualBuffer, VirtualBuffer)>,
    chunk: u64,
}

impl Kv for Virtual {
    fn prepare(&mut self, _: &CudaStream, layer: usize, _: u64) -> (u64, u64) {
        (self.bufs[layer].0.addr(), self.bufs[layer].1.addr())
    }
    fn row(&mut self, layer: usize, pos: u64) -> (u64, u64) {
        let end = (pos + 1) * ROW;
        let chunk = self.chunk;
        let (k, v) = &mut self.bufs[layer];
        for b in [&mut *k, &mut *v] {
            while b.len() < end {
                let more = chunk.min(b.capacity() - b.len());
                b.grow(more).unwrap();
            }
        }
        (k.addr() + pos * ROW, v.addr() + pos * ROW)
    }
}

struct Flat {
    device: Arc<CudaDevice>,
    bufs: Vec<(u64, u64)>,
}

impl Kv for Flat {
    fn prepare(&mut self, _: &CudaStream, layer: usize, _: u64) -> (u64, u64) {
        self.bufs[layer]
    }
    fn row(&mut self, layer: usize, pos: u64) -> (u64, u64) {
        let (k, v) = self.bufs[layer];
        (k + pos * ROW, v + pos * ROW)
    }
}

impl Drop for Flat {
    fn drop(&mut self) {
        for &(k, v) in &self.bufs {
            // SAFETY: allocated by `flat`, freed once; the caller synchronized the stream.
            unsafe {
                self.device.free(k).unwrap();
                self.device.free(v).unwrap();
            }
        }
    }
}

struct Staging {
    device: Arc<CudaDevice>,
    pages: Vec<(Vec<u64>, Vec<u64>)>,
    staging: (u64, u64),
}

impl Kv for Staging {
    fn prepare(&mut self, stream: &CudaStream, layer: usize, tokens: u64) -> (u64, u64) {
        let (kp, vp) = &self.pages[layer];
        for (pages, dst) in [(kp, self.staging.0), (vp, self.staging.1)] {
            let mut left = tokens;
            for (i, &page) in pages.iter().enumerate() {
                if left == 0 {
                    break;
                }
                let n = left.min(PAGE_TOKENS);
                // SAFETY: both ranges are device allocations of this device, alive until the
                // stream is synchronized.
                unsafe {
                    stream
                        .copy_async(dst + i as u64 * PAGE_TOKENS * ROW, page, n * ROW)
                        .unwrap()
                };
                left -= n;
            }
        }
        self.staging
    }
    fn row(&mut self, layer: usize, pos: u64) -> (u64, u64) {
        let page = (pos / PAGE_TOKENS) as usize;
        let (kp, vp) = &mut self.pages[layer];
        if page == kp.len() {
            kp.push(self.device.alloc(PAGE_TOKENS * ROW).unwrap());
            vp.push(self.device.alloc(PAGE_TOKENS * ROW).unwrap());
        }
        let at = (pos % PAGE_TOKENS) * ROW;
        (kp[page] + at, vp[page] + at)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let all = self
            .pages
            .iter()
            .flat_map(|(k, v)| k.iter().chain(v))
            .copied()
            .chain([self.staging.0, self.staging.1]);
        for p in all {
            // SAFETY: allocated here, freed once; the caller synchronized the stream.
            unsafe { self.device.free(p).unwrap() };
        }
    }
}

/// Writes token `pos`'s K and V rows of `layer` (both the row at `src`) with the copy kernel.
fn write_rows(
    kernels: &DecodeKernels,
    stream: &CudaStream,
    s: &mut dyn Kv,
    layer: usize,
    pos: u64,
    src: u64,
) {
    let (k, v) = s.row(layer, pos);
    for dst in [k, v] {
        // SAFETY: the rows are mapped device memory of this device, alive until the stream is
        // synchronized; `src` holds a row.
        unsafe {
            kernels
                .write_row(stream, KvDtype::F32, dst, src, ROW as u32 / 4)
                .unwrap()
        };
    }
}

fn flat(device: &Arc<CudaDevice>, bytes: u64) -> (u64, u64) {
    (device.alloc(bytes).unwrap(), device.alloc(bytes).unwrap())
}

/// What every context's run shares on the device: its mechanism, kernels and stream, and the
/// query, output and source row every step uses.
struct Gpu {
    device: Arc<CudaDevice>,
    backing: Arc<CudaVmmBacking>,
    granule: u64,
    kernels: DecodeKernels,
    stream: CudaStream,
    q: u64,
    out: u64,
    src: u64,
}

impl Gpu {
    fn new(mechanism: &CudaMechanism) -> Gpu {
        let device = mechanism.device().clone();
        let backing = mechanism.backing();
        let granule = VirtualBacking::granularity(backing.as_ref());
        let kernels = DecodeKernels::load(device.clone()).unwrap();
        let stream = CudaStream::new(device.clone()).unwrap();
        let q = device.alloc(u64::from(Q_HEADS * HEAD_DIM) * 4).unwrap();
        let out = device.alloc(u64::from(Q_HEADS * HEAD_DIM) * 4).unwrap();
        let src = device.alloc(ROW).unwrap();
        // SAFETY: allocated just above with these sizes.
        unsafe {
            stream
                .memset_async(q, 0x3c, u64::from(Q_HEADS * HEAD_DIM) * 4)
                .unwrap();
            stream.memset_async(src, 0x3c, ROW).unwrap();
        }
        Gpu {
            device,
            backing,
            granule,
            kernels,
            stream,
            q,
            out,
            src,
        }
    }

    /// The three strategies, each with `bytes` of KV per buffer.
    fn strategies(&self, bytes: u64) -> Vec<(&'static str, Box<dyn Kv>)> {
        let (device, backing) = (&self.device, &self.backing);
        vec![
            (
                "virtual",
                Box::new(Virtual {
                    bufs: (0..LAYERS)
                        .map(|_| {
                            let b = || {
                                VirtualBuffer::new(backing.clone(), bytes, MemoryRole::KvCache)
                                    .unwrap()
                            };
                            (b(), b())
                        })
                        .collect(),
                    chunk: self.granule * 4,
                }),
            ),
            (
                "preallocated",
                Box::new(Flat {
                    device: device.clone(),
                    bufs: (0..LAYERS).map(|_| flat(device, bytes)).collect(),
                }),
            ),
            (
                "staging_copy",
                Box::new(Staging {
                    device: device.clone(),
                    pages: vec![(Vec::new(), Vec::new()); LAYERS],
                    staging: flat(device, bytes),
                }),
            ),
        ]
    }

    /// The decode of `tokens` over `k` and `v`, with `partials` for the splits.
    fn launch(&self, k: u64, v: u64, tokens: u32, partials: u64) -> DecodeLaunch {
        DecodeLaunch {
            q: self.q,
            k,
            v,
            k_dtype: KvDtype::F32,
            v_dtype: KvDtype::F32,
            k_rows: RowLayout::dense(ROW),
            v_rows: RowLayout::dense(ROW),
            tokens,
            q_heads: Q_HEADS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            partials,
            out: self.out,
        }
    }

    /// Every strategy filled to the window's start of `context` (rows written by the copy
    /// kernel), then the window's steps in interleaved rounds: each strategy's steps per
    /// second in every round.
    fn timed(
        &self,
        strategies: &mut [(&str, Box<dyn Kv>)],
        context: u64,
        partials: u64,
    ) -> Vec<Vec<f64>> {
        let (kernels, stream, src) = (&self.kernels, &self.stream, self.src);
        let start = context - (ROUNDS * STEPS_PER_ROUND) as u64;
        for (_, s) in strategies.iter_mut() {
            for pos in 0..start {
                for layer in 0..LAYERS {
                    write_rows(kernels, stream, s.as_mut(), layer, pos, src);
                }
            }
            stream.synchronize().unwrap();
        }
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); strategies.len()];
        let mut pos = start;
        for _ in 0..ROUNDS {
            for (i, (_, s)) in strategies.iter_mut().enumerate() {
                let t0 = Instant::now();
                for step in 0..STEPS_PER_ROUND as u64 {
                    let at = pos + step;
                    for layer in 0..LAYERS {
                        write_rows(kernels, stream, s.as_mut(), layer, at, src);
                        let (k, v) = s.prepare(stream, layer, at + 1);
                        let launch = self.launch(k, v, (at + 1) as u32, partials);
                        // SAFETY: every address is live device memory of this device.
                        unsafe { kernels.decode(stream, &launch).unwrap() };
                    }
                }
                stream.synchronize().unwrap();
                rates[i].push(STEPS_PER_ROUND as f64 / t0.elapsed().as_secs_f64());
            }
            pos += STEPS_PER_ROUND as u64;
        }
        rates
    }

    /// The device's copy speed over `kv_bytes`, in GB/s.
    fn d2d_gb_s(&self, kv_bytes: u64) -> f64 {
        let (a, b) = flat(&self.device, kv_bytes / 2);
        let t0 = Instant::now();
        // SAFETY: two fresh allocations of this size.
        unsafe { self.stream.copy_async(b, a, kv_bytes / 2).unwrap() };
        self.stream.synchronize().unwrap();
        let d2d = kv_bytes as f64 / t0.elapsed().as_secs_f64() / 1e9;
        // SAFETY: allocated above; the stream is idle.
        unsafe {
            self.device.free(a).unwrap();
            self.device.free(b).unwrap();
        }
        d2d
    }

    /// One context's rows (each strategy's, then the ratios); returns the copy speed.
    fn context(&self, context: u64, rows: &mut Vec<serde_json::Value>) -> f64 {
        let bytes = context * ROW;
        let kv_bytes = bytes * 2 * LAYERS as u64;
        let mut strategies = self.strategies(bytes);
        let partials_bytes = self.launch(0, 0, context as u32, 0).partials_bytes();
        let partials = self.device.alloc(partials_bytes).unwrap();
        let mut rates = self.timed(&mut strategies, context, partials);
        let d2d = self.d2d_gb_s(kv_bytes);
        // SAFETY: allocated above; the stream is idle.
        unsafe { self.device.free(partials).unwrap() };
        let mut get = Vec::new();
        for (i, (name, _)) in strategies.iter().enumerate() {
            rates[i].sort_by(|x, y| x.total_cmp(y));
            let tokens_per_s = rates[i][rates[i].len() / 2];
            get.push((*name, tokens_per_s));
            rows.push(json!({
                "strategy": name,
                "context": context,
                "tokens_per_s": tokens_per_s,
                "kv_gb_s": kv_bytes as f64 * tokens_per_s / 1e9,
                "kv_bytes": kv_bytes,
            }));
        }
        let rate = |n: &str| get.iter().find(|(x, _)| *x == n).unwrap().1;
        rows.push(json!({
            "context": context,
            "virtual_vs_preallocated": rate("virtual") / rate("preallocated"),
            "virtual_vs_staging_copy": rate("virtual") / rate("staging_copy"),
            "virtual_kv_vs_d2d_copy": kv_bytes as f64 * rate("virtual") / 1e9 / d2d,
        }));
        d2d
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        // SAFETY: allocated in `new`; the stream is idle.
        unsafe {
            let _ = self.device.free(self.q);
            let _ = self.device.free(self.out);
            let _ = self.device.free(self.src);
        }
    }
}

/// The `cuda` section, or why it was skipped.
pub fn section() -> serde_json::Value {
    if !driver_present() {
        return json!({"skipped": "no CUDA driver (libcuda cannot be loaded on this machine)"});
    }
    if CudaDevice::count() == 0 {
        return json!({"skipped": "a CUDA driver is present but reports no device"});
    }
    let mechanism = CudaMechanism::new(0, 64).unwrap();
    let gpu = Gpu::new(&mechanism);
    let mut rows = Vec::new();
    let mut d2d = 0.0;
    for &context in &CONTEXTS {
        d2d = gpu.context(context, &mut rows);
    }
    drop(gpu);
    json!({
        "shape": {"layers": LAYERS, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "f32"},
        "d2d_copy_gb_s": d2d,
        "rows": rows,
    })
}
