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
    driver_present, CudaDevice, CudaMechanism, CudaStream, DecodeKernels, DecodeLaunch,
};
use procmem::kv::KvDtype;
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

/// The `cuda` section, or why it was skipped.
pub fn section() -> serde_json::Value {
    if !driver_present() {
        return json!({"skipped": "no CUDA driver (libcuda cannot be loaded on this machine)"});
    }
    if CudaDevice::count() == 0 {
        return json!({"skipped": "a CUDA driver is present but reports no device"});
    }
    let mechanism = CudaMechanism::new(0, 64).unwrap();
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
    let mut rows = Vec::new();
    let mut d2d = 0.0;
    for &context in &CONTEXTS {
        let bytes = context * ROW;
        let kv_bytes = bytes * 2 * LAYERS as u64;
        let window = (ROUNDS * STEPS_PER_ROUND) as u64;
        let mut strategies: Vec<(&str, Box<dyn Kv>)> = vec![
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
                    chunk: granule * 4,
                }),
            ),
            (
                "preallocated",
                Box::new(Flat {
                    device: device.clone(),
                    bufs: (0..LAYERS).map(|_| flat(&device, bytes)).collect(),
                }),
            ),
            (
                "staging_copy",
                Box::new(Staging {
                    device: device.clone(),
                    pages: vec![(Vec::new(), Vec::new()); LAYERS],
                    staging: flat(&device, bytes),
                }),
            ),
        ];
        let partials = device
            .alloc(
                DecodeLaunch {
                    q,
                    k: 0,
                    v: 0,
                    dtype: KvDtype::F32,
                    tokens: context as u32,
                    q_heads: Q_HEADS,
                    kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                    partials: 0,
                    out,
                }
                .partials_bytes(),
            )
            .unwrap();
        // Fill every strategy to the window's start (rows written by the copy kernel).
        let start = context - window;
        for (_, s) in &mut strategies {
            for pos in 0..start {
                for layer in 0..LAYERS {
                    write_rows(&kernels, &stream, s.as_mut(), layer, pos, src);
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
                        write_rows(&kernels, &stream, s.as_mut(), layer, at, src);
                        let (k, v) = s.prepare(&stream, layer, at + 1);
                        let launch = DecodeLaunch {
                            q,
                            k,
                            v,
                            dtype: KvDtype::F32,
                            tokens: (at + 1) as u32,
                            q_heads: Q_HEADS,
                            kv_heads: KV_HEADS,
                            head_dim: HEAD_DIM,
                            partials,
                            out,
                        };
                        // SAFETY: every address is live device memory of this device.
                        unsafe { kernels.decode(&stream, &launch).unwrap() };
                    }
                }
                stream.synchronize().unwrap();
                rates[i].push(STEPS_PER_ROUND as f64 / t0.elapsed().as_secs_f64());
            }
            pos += STEPS_PER_ROUND as u64;
        }
        // The device's copy speed over as many bytes as the KV.
        let (a, b) = flat(&device, kv_bytes / 2);
        let t0 = Instant::now();
        // SAFETY: two fresh allocations of this size.
        unsafe { stream.copy_async(b, a, kv_bytes / 2).unwrap() };
        stream.synchronize().unwrap();
        d2d = kv_bytes as f64 / t0.elapsed().as_secs_f64() / 1e9;
        // SAFETY: allocated above; the stream is idle.
        unsafe {
            device.free(a).unwrap();
            device.free(b).unwrap();
            device.free(partials).unwrap();
        }
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
        drop(strategies);
    }
    stream.synchronize().unwrap();
    // SAFETY: allocated above; the stream is idle.
    unsafe {
        device.free(q).unwrap();
        device.free(out).unwrap();
        device.free(src).unwrap();
    }
    json!({
        "shape": {"layers": LAYERS, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "f32"},
        "d2d_copy_gb_s": d2d,
        "rows": rows,
    })
}
