//! Reads physical truth for address ranges from `/proc/self/smaps`.

use std::ops::Range;

use crate::api::MemoryError;

/// Sums a `kB` field (such as `Rss` or `Anonymous`) over every mapping that lies inside `range`.
pub(crate) fn sum_field(range: Range<u64>, field: &str) -> Result<u64, MemoryError> {
    let text = std::fs::read_to_string("/proc/self/smaps")
        .map_err(|e| MemoryError::os("read /proc/self/smaps", e))?;
    Ok(sum_field_in(&text, range, field))
}

fn parse_header(line: &str) -> Option<Range<u64>> {
    let span = line.split_whitespace().next()?;
    let (start, end) = span.split_once('-')?;
    Some(u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?)
}

/// The parser behind [`sum_field`], on text already read.
pub(crate) fn sum_field_in(text: &str, range: Range<u64>, field: &str) -> u64 {
    let mut inside = false;
    let mut total_kb = 0u64;
    for line in text.lines() {
        if let Some(vma) = parse_header(line) {
            inside = vma.start >= range.start && vma.end <= range.end;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kb = rest.trim().trim_end_matches("kB").trim();
            total_kb += kb.parse::<u64>().unwrap_or(0);
        }
    }
    total_kb * 1024
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_only_mappings_inside_the_range() {
        let text = "\
1000-3000 rw-p 00000000 00:00 0
Rss:                   8 kB
Anonymous:             4 kB
3000-4000 rw-s 00000000 00:01 7 /memfd:procmem (deleted)
Rss:                   4 kB
Anonymous:             0 kB
4000-6000 rw-p 00000000 00:00 0
Anonymous:           100 kB
";
        assert_eq!(sum_field_in(text, 0x1000..0x4000, "Anonymous"), 4096);
        assert_eq!(sum_field_in(text, 0x1000..0x4000, "Rss"), 12 * 1024);
        assert_eq!(sum_field_in(text, 0x0..0x10000, "Anonymous"), 104 * 1024);
    }
}
