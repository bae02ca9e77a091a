//! The tier's two file formats, encoded and decoded: a block file (header, payload, CRC-32)
//! and the index (its entries, then a CRC-32). Decoding trusts nothing: every count and length
//! is checked against the bytes there before it is used.

use std::collections::HashMap;

use super::{Entry, BLOCK_MAGIC, INDEX_MAGIC, MAX_BLOCK_BYTES, MAX_BLOCK_TOKENS, VERSION};

/// A block file, decoded and checked.
pub(super) struct Block {
    pub(super) key: u64,
    pub(super) parent: u64,
    pub(super) tokens: Vec<u32>,
    /// Where the payload lies in the file's bytes.
    pub(super) payload: std::ops::Range<usize>,
    pub(super) crc: u32,
}

impl Block {
    pub(super) fn entry(&self) -> Entry {
        Entry {
            parent: self.parent,
            tokens: self.tokens.clone(),
            bytes: self.payload.len() as u64,
            crc: self.crc,
            last_use: 0,
        }
    }
}

pub(super) fn block_len(tokens: usize, bytes: u64) -> u64 {
    // magic, version, model, key, parent, token count, tokens, payload length, payload, CRC.
    4 + 4 + 8 + 8 + 8 + 4 + 4 * tokens as u64 + 8 + bytes + 4
}

pub(super) fn encode_block(
    model: u64,
    key: u64,
    parent: u64,
    tokens: &[u32],
    payload: &[u8],
) -> Vec<u8> {
    let mut raw = Vec::with_capacity(block_len(tokens.len(), payload.len() as u64) as usize);
    raw.extend_from_slice(BLOCK_MAGIC);
    raw.extend_from_slice(&VERSION.to_le_bytes());
    for v in [model, key, parent] {
        raw.extend_from_slice(&v.to_le_bytes());
    }
    raw.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        raw.extend_from_slice(&t.to_le_bytes());
    }
    raw.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    raw.extend_from_slice(payload);
    let crc = crc32fast::hash(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    raw
}

/// Reads little-endian fields off a byte slice, refusing to run past its end.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn tokens(&mut self) -> Result<Vec<u32>, String> {
        let n = self.u32()? as usize;
        if n > MAX_BLOCK_TOKENS || n * 4 > self.0.len() {
            return Err(format!("claims {n} tokens"));
        }
        (0..n).map(|_| self.u32()).collect()
    }
}

/// Splits off and checks the trailing CRC-32; returns the checked bytes and the CRC.
fn checked(raw: &[u8]) -> Result<(&[u8], u32), String> {
    if raw.len() < 4 {
        return Err("truncated".into());
    }
    let (body, tail) = raw.split_at(raw.len() - 4);
    let crc = u32::from_le_bytes(tail.try_into().expect("4 bytes"));
    if crc32fast::hash(body) != crc {
        return Err("checksum mismatch".into());
    }
    Ok((body, crc))
}

fn header(c: &mut Cursor<'_>, magic: &[u8; 4], model: u64) -> Result<(), String> {
    if c.take(4)? != magic {
        return Err("not a procmem disk tier file".into());
    }
    let version = c.u32()?;
    if version != VERSION {
        return Err(format!("version {version}"));
    }
    let theirs = c.u64()?;
    if theirs != model {
        return Err(format!("another model's ({theirs:016x})"));
    }
    Ok(())
}

pub(super) fn decode_block(raw: &[u8], model: u64) -> Result<Block, String> {
    let (body, crc) = checked(raw)?;
    let mut c = Cursor(body);
    header(&mut c, BLOCK_MAGIC, model)?;
    let (key, parent) = (c.u64()?, c.u64()?);
    let tokens = c.tokens()?;
    let len = c.u64()?;
    if len != c.0.len() as u64 {
        return Err(format!("claims {len} payload bytes, holds {}", c.0.len()));
    }
    let start = body.len() - c.0.len();
    Ok(Block {
        key,
        parent,
        tokens,
        payload: start..body.len(),
        crc,
    })
}

pub(super) fn encode_index(model: u64, entries: &HashMap<u64, Entry>) -> Vec<u8> {
    let mut raw = Vec::new();
    raw.extend_from_slice(INDEX_MAGIC);
    raw.extend_from_slice(&VERSION.to_le_bytes());
    raw.extend_from_slice(&model.to_le_bytes());
    raw.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    let mut keys: Vec<_> = entries.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let e = &entries[&key];
        for v in [key, e.parent, e.bytes, e.last_use] {
            raw.extend_from_slice(&v.to_le_bytes());
        }
        raw.extend_from_slice(&e.crc.to_le_bytes());
        raw.extend_from_slice(&(e.tokens.len() as u32).to_le_bytes());
        for t in &e.tokens {
            raw.extend_from_slice(&t.to_le_bytes());
        }
    }
    let crc = crc32fast::hash(&raw);
    raw.extend_from_slice(&crc.to_le_bytes());
    raw
}

pub(super) fn decode_index(raw: &[u8], model: u64) -> Result<HashMap<u64, Entry>, String> {
    let (body, _) = checked(raw)?;
    let mut c = Cursor(body);
    header(&mut c, INDEX_MAGIC, model)?;
    let count = c.u64()?;
    // Each entry takes at least 40 bytes: a count past what the file holds is a lie.
    if count > c.0.len() as u64 / 40 {
        return Err(format!("claims {count} entries"));
    }
    let mut entries = HashMap::with_capacity(count as usize);
    for _ in 0..count {
        let (key, parent, bytes, last_use) = (c.u64()?, c.u64()?, c.u64()?, c.u64()?);
        let crc = c.u32()?;
        let tokens = c.tokens()?;
        if bytes > MAX_BLOCK_BYTES {
            return Err(format!("an entry claims {bytes} bytes"));
        }
        let entry = Entry {
            parent,
            tokens,
            bytes,
            crc,
            last_use,
        };
        if key == super::chains::ROOT {
            return Err("names the root (0) as a block".into());
        }
        if entries.insert(key, entry).is_some() {
            return Err(format!("names block {key:016x} twice"));
        }
    }
    if !c.0.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(entries)
}
