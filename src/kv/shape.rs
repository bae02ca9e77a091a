//! KV geometry: how many bytes a token takes in one layer's K (or V) buffer, how buffers are
//! sized and grown, and which token ranges form whole shareable blocks.

use thiserror::Error;

/// The element type KV is kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// 32-bit IEEE float.
    #[default]
    F32,
    /// 16-bit IEEE float (`half::f16`), as servers usually keep KV.
    F16,
    /// Eight bits a value in blocks of 32 with an `f16` scale (llama.cpp's `q8_0`, see
    /// [`q8_0`](super::q8_0)): 34 bytes for 32 values. Rows are written from `f32` and read
    /// back widened; a head must be whole blocks.
    Q8_0,
}

impl KvDtype {
    /// Every type, in the order `--kv-dtype` lists them.
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0];

    /// Bytes of `values` values in this type: `None` when they overflow, or for `q8_0` when
    /// they are not whole blocks of 32.
    pub const fn row_bytes(self, values: usize) -> Option<u64> {
        let bytes = match self {
            KvDtype::F32 => values.checked_mul(4),
            KvDtype::F16 => values.checked_mul(2),
            KvDtype::Q8_0 => super::q8_0::bytes_for(values),
        };
        match bytes {
            Some(b) => Some(b as u64),
            None => None,
        }
    }

    /// Values that are written and read together: 1, or 32 for `q8_0`'s blocks.
    pub const fn block_values(self) -> usize {
        match self {
            KvDtype::F32 | KvDtype::F16 => 1,
            KvDtype::Q8_0 => super::q8_0::BLOCK,
        }
    }

    /// The name llama.cpp and the flags use: `f32`, `f16`, `q8_0`.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    /// Parses a [`KvDtype::name`] (any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvDtype::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown KV type {s:?}: one of f32, f16, q8_0"))
    }
}

/// Why a KV shape cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ShapeError {
    /// A dimension is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// Query heads must group evenly over KV heads.
    #[error("{q_heads} query heads do not group evenly over {kv_heads} KV heads")]
    Grouping {
        /// Query heads.
        q_heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// The smallest block of whole tokens filling whole granules spans more than
    /// [`MAX_BLOCK_GRANULES`] granules.
    #[error("a token takes {token_bytes} bytes: whole tokens fill whole granules of {granularity} bytes only over more than {MAX_BLOCK_GRANULES} granules")]
    Unaligned {
        /// Bytes per token.
        token_bytes: u64,
        /// Mapping granularity.
        granularity: u64,
    },
    /// The sizes overflow.
    #[error("the KV buffer size overflows")]
    Overflow,
    /// A head is not whole blocks of the element type (`q8_0` needs a head dimension that is a
    /// multiple of 32).
    #[error("{dtype} keeps values in blocks of {block}: a head of {head_dim} is not whole blocks")]
    PartialBlock {
        /// The element type.
        dtype: KvDtype,
        /// Its block.
        block: usize,
        /// The shape's head dimension.
        head_dim: usize,
    },
}

/// The heads of one attention call: query heads, KV heads (which divide them; each serves a
/// group of query heads) and the head dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub q: usize,
    /// KV heads.
    pub kv: usize,
    /// Elements of one head.
    pub dim: usize,
}

impl Heads {
    /// `q` query heads over `kv` KV heads, each of `dim` elements.
    pub const fn new(q: usize, kv: usize, dim: usize) -> Self {
        Heads { q, kv, dim }
    }
}

/// K or V: which of a layer's two buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvPart {
    /// The keys (buffer `2 × layer`).
    K,
    /// The values (buffer `2 × layer + 1`).
    V,
}

impl KvPart {
    /// Both, K first.
    pub const BOTH: [KvPart; 2] = [KvPart::K, KvPart::V];

    /// What buffer `buffer` of a sequence holds (K then V for each layer).
    pub const fn of_buffer(buffer: usize) -> KvPart {
        if buffer % 2 == 0 {
            KvPart::K
        } else {
            KvPart::V
        }
    }
}

/// Bytes of one group of rows where rows are grouped ([`RowLayout`]): a host page.
pub const ROW_GROUP_BYTES: u64 = 4096;

/// How one buffer's rows lie: row `t` at `(t / group_rows) × group_bytes + (t % group_rows) ×
/// row_bytes`. Rows are dense (`group_rows` 1, `group_bytes` = `row_bytes`) except where a
/// `q8_0` row would fill whole pages only after many rows (SmolLM2's 204-byte rows: 1,024):
/// there they come 20 to a 4 KiB page with 16 bytes to spare, so a shareable block is 20
/// tokens, not 1,024 ([`KvShape::rows`]). A row never straddles a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowLayout {
    /// Bytes of one row.
    pub row_bytes: u64,
    /// Rows in one group.
    pub group_rows: u64,
    /// Bytes from one group to the next (at least `group_rows × row_bytes`).
    pub group_bytes: u64,
}

impl RowLayout {
    /// Rows one after the other.
    pub const fn dense(row_bytes: u64) -> Self {
        RowLayout {
            row_bytes,
            group_rows: 1,
            group_bytes: row_bytes,
        }
    }

    /// The layout rows of `row_bytes` of `dtype` take: grouped in [`ROW_GROUP_BYTES`] where
    /// the type is `q8_0`, dense rows would fill whole pages only after more than 64 rows, and
    /// a page of rows wastes at most 1/64 of itself; dense otherwise (every `f32` and `f16`
    /// row, and `q8_0` rows of 1,024 values: 64 to 17 pages).
    pub fn of(dtype: KvDtype, row_bytes: u64) -> Self {
        let page = ROW_GROUP_BYTES;
        if dtype != KvDtype::Q8_0 || row_bytes == 0 || row_bytes > page {
            return RowLayout::dense(row_bytes);
        }
        let rows = page / row_bytes;
        let dense_rows = page / gcd(row_bytes, page);
        let spare = page - rows * row_bytes;
        if dense_rows > 64 && spare * 64 <= page {
            RowLayout {
                row_bytes,
                group_rows: rows,
                group_bytes: page,
            }
        } else {
            RowLayout::dense(row_bytes)
        }
    }

    /// Whether rows are one after the other.
    pub fn is_dense(&self) -> bool {
        self.group_rows == 1 && self.group_bytes == self.row_bytes
    }

    /// Where row `row` starts: also the bytes rows `0..row` take, the spare bytes of every
    /// whole group among them included (saturating).
    pub fn offset(&self, row: u64) -> u64 {
        let g = self.group_rows.max(1);
        (row / g)
            .saturating_mul(self.group_bytes)
            .saturating_add((row % g) * self.row_bytes)
    }

    /// [`RowLayout::offset`], `None` on overflow.
    pub fn checked_offset(&self, row: u64) -> Option<u64> {
        let g = self.group_rows.max(1);
        (row / g)
            .checked_mul(self.group_bytes)?
            .checked_add((row % g).checked_mul(self.row_bytes)?)
    }

    /// Whole rows within the first `bytes` bytes.
    pub fn rows_within(&self, bytes: u64) -> u64 {
        if self.group_bytes == 0 || self.row_bytes == 0 {
            return 0;
        }
        let (groups, rest) = (bytes / self.group_bytes, bytes % self.group_bytes);
        groups * self.group_rows + (rest / self.row_bytes).min(self.group_rows)
    }

    /// How many rows from row `from` take exactly `bytes` bytes (`None` where no whole number
    /// of rows does).
    pub fn rows_in(&self, from: u64, bytes: u64) -> Option<u64> {
        let start = self.checked_offset(from)?;
        let end = start.checked_add(bytes)?;
        let rows = self.rows_within(end);
        (rows >= from && self.offset(rows) == end).then(|| rows - from)
    }

    /// The fewest rows filling whole granules of `granularity` bytes (`None` on overflow).
    pub fn rows_filling(&self, granularity: u64) -> Option<u64> {
        (lcm(self.group_bytes, granularity)? / self.group_bytes).checked_mul(self.group_rows)
    }
}

/// The attention geometry of a model, as far as KV is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Transformer layers.
    pub layers: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (query heads are grouped over them).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Longest sequence, in tokens: the address space each buffer reserves.
    pub max_tokens: usize,
    /// The element type of K (llama.cpp's `-ctk`).
    pub k_dtype: KvDtype,
    /// The element type of V (llama.cpp's `-ctv`).
    pub v_dtype: KvDtype,
}

impl KvShape {
    /// The same shape with K and V both kept as `dtype`.
    pub const fn with_dtype(self, dtype: KvDtype) -> Self {
        KvShape {
            k_dtype: dtype,
            v_dtype: dtype,
            ..self
        }
    }

    /// Checks the shape against a mapping granularity.
    pub fn validate(&self, granularity: u64) -> Result<(), ShapeError> {
        for (name, v) in [
            ("layers", self.layers),
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_tokens", self.max_tokens),
        ] {
            if v == 0 {
                return Err(ShapeError::Zero(name));
            }
        }
        if self.q_heads % self.kv_heads != 0 {
            return Err(ShapeError::Grouping {
                q_heads: self.q_heads,
                kv_heads: self.kv_heads,
            });
        }
        if granularity == 0 {
            return Err(ShapeError::Zero("granularity"));
        }
        self.q_heads
            .checked_mul(self.head_dim)
            .and_then(|_| self.layers.checked_mul(2))
            .ok_or(ShapeError::Overflow)?;
        let mut buffers = 0u64;
        for part in KvPart::BOTH {
            let dtype = self.dtype(part);
            let block = dtype.block_values();
            if self.head_dim % block != 0 {
                return Err(ShapeError::PartialBlock {
                    dtype,
                    block,
                    head_dim: self.head_dim,
                });
            }
            // Every product the store computes from the shape, checked once here.
            let token_bytes = self
                .kv_heads
                .checked_mul(self.head_dim)
                .and_then(|f| dtype.row_bytes(f))
                .ok_or(ShapeError::Overflow)?;
            let buffer = RowLayout::of(dtype, token_bytes)
                .checked_offset(self.max_tokens as u64)
                .and_then(|b| b.checked_next_multiple_of(granularity))
                .ok_or(ShapeError::Overflow)?;
            buffers = buffers.checked_add(buffer).ok_or(ShapeError::Overflow)?;
        }
        // A shareable block is the smallest run of whole tokens that fills whole granules in K
        // and in V; refused when that takes more than `MAX_BLOCK_GRANULES` granules in either.
        let block_tokens = self
            .checked_block_tokens(granularity)
            .ok_or(ShapeError::Overflow)?;
        for part in KvPart::BOTH {
            let block = self
                .rows(part)
                .checked_offset(block_tokens)
                .ok_or(ShapeError::Overflow)?;
            if block / granularity > MAX_BLOCK_GRANULES {
                return Err(ShapeError::Unaligned {
                    token_bytes: self.token_bytes(part),
                    granularity,
                });
            }
        }
        // A sequence reserves one buffer per K and V of every layer.
        (self.layers as u64)
            .checked_mul(buffers)
            .ok_or(ShapeError::Overflow)?;
        Ok(())
    }

    /// The element type of `part`.
    pub const fn dtype(&self, part: KvPart) -> KvDtype {
        match part {
            KvPart::K => self.k_dtype,
            KvPart::V => self.v_dtype,
        }
    }

    /// Elements per token in one K (or V) buffer.
    pub fn token_elems(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one token's row in one buffer of `part` (of a shape that
    /// [`KvShape::validate`] passed); where rows are grouped a page holds a few spare bytes
    /// besides ([`KvShape::rows`]).
    pub fn token_bytes(&self, part: KvPart) -> u64 {
        self.dtype(part)
            .row_bytes(self.token_elems())
            .unwrap_or(u64::MAX)
    }

    /// How the rows of a buffer of `part` lie ([`RowLayout::of`] its type and row bytes).
    pub fn rows(&self, part: KvPart) -> RowLayout {
        RowLayout::of(self.dtype(part), self.token_bytes(part))
    }

    /// Bytes one token takes over every buffer of a sequence: a K and a V row per layer.
    pub fn token_bytes_all(&self) -> u64 {
        self.layers as u64 * (self.token_bytes(KvPart::K) + self.token_bytes(KvPart::V))
    }

    /// Bytes of one head of one token in `part`, from one head to the next within a row.
    pub fn head_bytes(&self, part: KvPart) -> u64 {
        self.dtype(part)
            .row_bytes(self.head_dim)
            .unwrap_or(u64::MAX)
    }

    /// Its heads, as an attention call takes them.
    pub fn heads(&self) -> Heads {
        Heads::new(self.q_heads, self.kv_heads, self.head_dim)
    }

    /// Buffers per sequence: a K and a V per layer.
    pub fn buffers(&self) -> usize {
        2 * self.layers
    }

    /// Address space one buffer of `part` reserves: `max_tokens` rounded up to the granularity.
    pub fn buffer_bytes(&self, part: KvPart, granularity: u64) -> u64 {
        self.rows(part)
            .offset(self.max_tokens as u64)
            .next_multiple_of(granularity)
    }

    /// Tokens in one shareable block: the smallest whole number of tokens filling whole
    /// granules in K and in V (768-byte tokens on 4 KiB pages: 16 tokens in 3 pages; 204-byte
    /// `q8_0` tokens, 20 to a page: 40 in two pages, as grouped blocks are at least
    /// [`MIN_GROUPED_BLOCK_TOKENS`]).
    pub fn block_tokens(&self, granularity: u64) -> usize {
        self.checked_block_tokens(granularity)
            .map_or(1, |b| b as usize)
    }

    /// [`KvShape::block_tokens`], `None` where a size overflows.
    fn checked_block_tokens(&self, granularity: u64) -> Option<u64> {
        let rows = |part| {
            let dtype = self.dtype(part);
            let t = dtype.row_bytes(self.kv_heads.checked_mul(self.head_dim)?)?;
            Some(RowLayout::of(dtype, t))
        };
        let (k, v) = (rows(KvPart::K)?, rows(KvPart::V)?);
        let whole = lcm(k.rows_filling(granularity)?, v.rows_filling(granularity)?)?;
        if k.is_dense() && v.is_dense() {
            return Some(whole);
        }
        // Grouped rows make small blocks (20 tokens in a page): every block is a mapping in
        // each of the sequence's buffers, so they are kept to at least
        // `MIN_GROUPED_BLOCK_TOKENS` (the process's mappings are bounded by vm.max_map_count).
        whole.checked_mul(MIN_GROUPED_BLOCK_TOKENS.div_ceil(whole))
    }

    /// Bytes of one shareable block in one buffer of `part`.
    pub fn block_bytes(&self, part: KvPart, granularity: u64) -> u64 {
        self.rows(part)
            .offset(self.block_tokens(granularity) as u64)
    }

    /// Bytes every buffer of a sequence maps to hold `tokens` tokens, growing `chunk` bytes at
    /// a time (K and V each by their own rows), over all the buffers.
    pub fn mapped_bytes(&self, tokens: usize, chunk: u64) -> u64 {
        let per_layer: u64 = KvPart::BOTH
            .iter()
            .map(|p| mapped_bytes_for(tokens, self.rows(*p), chunk, u64::MAX))
            .sum();
        per_layer.saturating_mul(self.layers as u64)
    }

    /// Bytes of one shareable block over every buffer of a sequence.
    pub fn block_bytes_all(&self, granularity: u64) -> u64 {
        let both: u64 = KvPart::BOTH
            .iter()
            .map(|p| self.block_bytes(*p, granularity))
            .sum();
        both.saturating_mul(self.layers as u64)
    }
}

/// The most granules one shareable block may span.
pub const MAX_BLOCK_GRANULES: u64 = 128;

/// The fewest tokens of a shareable block where rows are grouped (`q8_0`'s 20 to a page make
/// blocks of 40): about as many blocks a prompt as `f16`'s 32-token blocks, so as many
/// mappings.
pub const MIN_GROUPED_BLOCK_TOKENS: u64 = 32;

/// Greatest common divisor (of two non-zero numbers).
fn gcd(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    x
}

/// Least common multiple, `None` on overflow or a zero.
fn lcm(a: u64, b: u64) -> Option<u64> {
    if a == 0 || b == 0 {
        return None;
    }
    (a / gcd(a, b)).checked_mul(b)
}

/// Bytes of a buffer of rows laid out as `rows` that must be mapped to hold `tokens`, growing
/// in `chunk`-byte steps and never past `capacity`.
pub fn mapped_bytes_for(tokens: usize, rows: RowLayout, chunk: u64, capacity: u64) -> u64 {
    rows.offset(tokens as u64)
        .next_multiple_of(chunk)
        .min(capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Defect (issue 11, 2): extreme shapes overflowed (a panic in debug, a wrap to a zero
    /// divisor in release) instead of being refused.
    #[test]
    fn extreme_shapes_are_refused_not_overflowed() {
        let big = usize::MAX;
        for s in [
            KvShape {
                kv_heads: big,
                q_heads: big,
                ..shape()
            },
            KvShape {
                head_dim: big,
                ..shape()
            },
            KvShape {
                head_dim: 1 << 62,
                ..shape()
            },
            KvShape {
                layers: big,
                ..shape()
            },
            KvShape {
                layers: usize::MAX / 2,
                ..shape()
            },
            KvShape {
                max_tokens: big,
                ..shape()
            },
        ] {
            assert_eq!(s.validate(4096), Err(ShapeError::Overflow), "{s:?}");
        }
        assert_eq!(shape().validate(0), Err(ShapeError::Zero("granularity")));
        assert_eq!(shape().validate(4096), Ok(()));
        // 3 KV heads of 64 f32s (SmolLM2): 768-byte tokens, 16 to a block of 3 pages.
        let smol = KvShape {
            kv_heads: 3,
            q_heads: 9,
            head_dim: 64,
            ..shape()
        };
        assert_eq!(smol.validate(4096), Ok(()));
        assert_eq!(
            (smol.block_tokens(4096), smol.block_bytes(KvPart::K, 4096)),
            (16, 12288)
        );
        // A prime token size would need thousands of pages per block: refused.
        let odd = KvShape {
            kv_heads: 1,
            head_dim: 1021,
            q_heads: 1,
            ..shape()
        };
        assert!(matches!(
            odd.validate(4096),
            Err(ShapeError::Unaligned { .. })
        ));
    }

    fn shape() -> KvShape {
        KvShape {
            layers: 2,
            q_heads: 8,
            kv_heads: 2,
            head_dim: 16,
            max_tokens: 1000,
            k_dtype: KvDtype::F32,
            v_dtype: KvDtype::F32,
        }
    }

    #[test]
    fn geometry_follows_the_shape() {
        let s = shape();
        assert_eq!(s.token_bytes(KvPart::K), 128);
        assert_eq!(
            s.buffer_bytes(KvPart::K, 4096),
            128_000u64.next_multiple_of(4096)
        );
        assert_eq!(s.block_tokens(4096), 32);
        assert_eq!(s.block_bytes(KvPart::K, 4096), 4096);
        let half = KvShape {
            k_dtype: KvDtype::F16,
            v_dtype: KvDtype::F16,
            ..s
        };
        assert_eq!(half.token_bytes(KvPart::K), 64);
        assert_eq!(half.block_tokens(4096), 64);
        let wide = KvShape {
            kv_heads: 8,
            head_dim: 256,
            ..s
        };
        assert_eq!(
            wide.block_tokens(4096),
            1,
            "a token larger than a granule is its own block"
        );
        let rows = RowLayout::dense(128);
        assert_eq!(mapped_bytes_for(33, rows, 16384, 1 << 20), 16384);
        assert_eq!(mapped_bytes_for(129, rows, 16384, 1 << 20), 32768);
        assert_eq!(mapped_bytes_for(129, rows, 16384, 20000), 20000);
    }

    /// `q8_0` keeps 32 values in 34 bytes: SmolLM2's 3 KV heads of 64 take 204 bytes a token,
    /// which would fill whole pages only 1,024 at a time (51 pages); grouped 20 to a page (16
    /// bytes spare) a block is 40 tokens in two pages (at least 32 tokens).
    #[test]
    fn q8_0_rows_are_whole_blocks() {
        let smol = KvShape {
            kv_heads: 3,
            q_heads: 9,
            head_dim: 64,
            k_dtype: KvDtype::Q8_0,
            v_dtype: KvDtype::Q8_0,
            ..shape()
        };
        assert_eq!(smol.validate(4096), Ok(()));
        assert_eq!(
            (smol.token_bytes(KvPart::K), smol.head_bytes(KvPart::K)),
            (204, 68)
        );
        assert_eq!(
            smol.rows(KvPart::K),
            RowLayout {
                row_bytes: 204,
                group_rows: 20,
                group_bytes: 4096
            }
        );
        assert_eq!(
            (smol.block_tokens(4096), smol.block_bytes(KvPart::K, 4096)),
            (40, 2 * 4096),
            "20 rows a page; two pages, so a block is at least 32 tokens"
        );
        assert_eq!(smol.buffer_bytes(KvPart::V, 4096), 50 * 4096, "1,000 rows");
        assert_eq!(smol.mapped_bytes(21, 4096), 2 * 2 * 2 * 4096);
        // On 2 MiB granules: 512 pages of 20 rows.
        assert_eq!(smol.block_tokens(2 << 20), 10240);
        assert_eq!(
            KvShape {
                head_dim: 48,
                ..smol
            }
            .validate(4096),
            Err(ShapeError::PartialBlock {
                dtype: KvDtype::Q8_0,
                block: 32,
                head_dim: 48
            })
        );
        // f16 K beside q8_0 V: 384- and 204-byte rows; a block is 160 tokens for both (15
        // pages of K, 32 rows to 3; 8 of V, 20 rows to 1).
        let mixed = KvShape {
            k_dtype: KvDtype::F16,
            ..smol
        };
        assert_eq!(mixed.validate(4096), Ok(()));
        assert_eq!(mixed.block_tokens(4096), 160);
        assert_eq!(
            (
                mixed.block_bytes(KvPart::K, 4096),
                mixed.block_bytes(KvPart::V, 4096)
            ),
            (15 * 4096, 8 * 4096)
        );
        assert_eq!(mixed.token_bytes_all(), 2 * (384 + 204));
        assert_eq!(mixed.block_bytes_all(4096), 2 * (15 + 8) * 4096);
        // Eight KV heads of 128 (1,088-byte rows): three to a page would leave 832 bytes
        // spare; dense rows fill 17 pages every 64.
        let wide = KvShape {
            kv_heads: 8,
            q_heads: 32,
            head_dim: 128,
            ..smol
        };
        assert!(wide.rows(KvPart::K).is_dense());
        assert_eq!(wide.block_tokens(4096), 64);
        assert_eq!(KvDtype::Q8_0.row_bytes(usize::MAX / 32 * 32), None);
        assert_eq!(KvDtype::F32.row_bytes(usize::MAX), None);
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>(), Ok(d));
        }
        assert_eq!("Q8_0".parse::<KvDtype>(), Ok(KvDtype::Q8_0));
        assert!("q4_0".parse::<KvDtype>().is_err());
    }

    /// Where grouped rows lie, and the byte counts that find rows again.
    #[test]
    fn grouped_rows_leave_each_page_s_spare_bytes_between_groups() {
        let g = RowLayout::of(KvDtype::Q8_0, 204);
        assert_eq!((g.group_rows, g.group_bytes), (20, 4096));
        assert_eq!(
            [0, 1, 19, 20, 21, 40].map(|r| g.offset(r)),
            [0, 204, 19 * 204, 4096, 4300, 8192]
        );
        assert_eq!(
            [0, 203, 204, 4080, 4095, 4096, 4300].map(|b| g.rows_within(b)),
            [0, 0, 1, 20, 20, 20, 21]
        );
        assert_eq!(g.rows_in(20, 204 * 3), Some(3));
        assert_eq!(g.rows_in(19, 204 + 16 + 204), Some(2), "across a page");
        assert_eq!(g.rows_in(19, 204 * 2), None, "the spare bytes are counted");
        assert_eq!(g.rows_in(0, 4096), Some(20));
        assert_eq!(g.rows_in(0, 4080), None, "20 rows end where the page does");
        assert_eq!(g.rows_filling(4096), Some(20));
        assert_eq!(g.offset(u64::MAX), u64::MAX);
        assert_eq!(g.checked_offset(u64::MAX), None);
        // Rows that fill pages quickly, or would waste much of a page, stay dense.
        for (dtype, bytes) in [
            (KvDtype::F32, 768),
            (KvDtype::F16, 204),
            (KvDtype::Q8_0, 1088),
            (KvDtype::Q8_0, 5 * 1088),
        ] {
            assert!(RowLayout::of(dtype, bytes).is_dense(), "{dtype} {bytes}");
        }
        let d = RowLayout::dense(768);
        assert_eq!(
            (d.offset(5), d.rows_within(4000), d.rows_in(2, 1536)),
            (3840, 5, Some(2))
        );
        assert_eq!(d.rows_filling(4096), Some(16));
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert_eq!(
            KvShape {
                layers: 0,
                ..shape()
            }
            .validate(4096),
            Err(ShapeError::Zero("layers"))
        );
        assert!(matches!(
            KvShape {
                q_heads: 7,
                ..shape()
            }
            .validate(4096),
            Err(ShapeError::Grouping { .. })
        ));
        // Tokens that do not divide a page now make blocks of several pages.
        let s24 = KvShape {
            head_dim: 24,
            ..shape()
        };
        assert_eq!(s24.validate(4096), Ok(()));
        assert_eq!(s24.block_bytes(KvPart::K, 4096) % 4096, 0);
        assert_eq!(
            s24.block_bytes(KvPart::K, 4096) % s24.token_bytes(KvPart::K),
            0
        );
        assert!(matches!(
            KvShape {
                max_tokens: usize::MAX,
                ..shape()
            }
            .validate(4096),
            Err(ShapeError::Overflow)
        ));
        assert!(shape().validate(4096).is_ok());
    }
}
