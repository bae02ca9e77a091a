//! Grows one layer's virtual KV buffer token by token and prints what was mapped, with the
//! kernel's own count of the physical bytes behind it. The base address never moves.
//!
//! `cargo run --release --example grow_kv -- [TOKENS] [BYTES_PER_TOKEN]`

use procmem::host::HostMechanism;
use procmem::{MemoryRole, VirtualBuffer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let tokens: u64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(16_384);
    // 8 KV heads x 128 dims x 2 bytes: one layer's K for one token of an 8B-class model.
    let per_token: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(2048);
    if tokens == 0 || per_token == 0 {
        return Err("TOKENS and BYTES_PER_TOKEN must be positive".into());
    }
    let host = HostMechanism::new()?;
    let capacity = tokens
        .checked_mul(per_token)
        .ok_or("TOKENS x BYTES_PER_TOKEN overflows")?;
    let mut kv = VirtualBuffer::new(host.backing(), capacity, MemoryRole::KvCache)?;
    let g = kv.granularity();
    println!(
        "reserved {} bytes at {:#x}; granularity {} bytes = {} tokens per granule",
        kv.capacity(),
        kv.addr(),
        g,
        g / per_token.min(g).max(1)
    );
    println!(
        "{:>8} {:>12} {:>12} {:>14} {:>10}",
        "tokens", "mapped", "os_resident", "base", "grows"
    );
    let base = kv.addr();
    let mut grows = 0u64;
    let mut next_report = 1u64;
    for t in 1..=tokens {
        let need = t * per_token;
        if need > kv.len() {
            kv.grow((need - kv.len()).next_multiple_of(g))?;
            grows += 1;
        }
        let start = ((t - 1) * per_token) as usize;
        kv.as_mut_slice()?[start..start + per_token as usize].fill((t % 251) as u8);
        assert_eq!(kv.addr(), base, "the base address moved");
        if t == next_report || t == tokens {
            println!(
                "{:>8} {:>12} {:>12} {:>#14x} {:>10}",
                t,
                kv.len(),
                kv.resident_bytes()?,
                kv.addr(),
                grows
            );
            next_report *= 2;
        }
    }
    let bytes = kv.as_slice()?;
    let intact = (1..=tokens).all(|t| bytes[((t - 1) * per_token) as usize] == (t % 251) as u8);
    println!(
        "every token's bytes intact: {intact}; resident {} bytes for {} bytes of tokens (waste {} bytes)",
        kv.resident_bytes()?,
        tokens * per_token,
        kv.len() - tokens * per_token
    );
    drop(kv);
    println!(
        "after drop: {} bytes resident in the backing",
        host.backing().resident_bytes()?
    );
    if !intact {
        return Err("token bytes were corrupted".into());
    }
    Ok(())
}
