//! The tier's files read as a hostile directory may hold them (issue 50): only a regular file
//! is read, opened without following a link and without waiting on a FIFO or a device, its
//! size checked with `fstat` before a byte is read and read no further than that; a file that
//! fails is removed, so the next start does not pay for it again.

use std::fs::{self, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The most bytes an index may take: 48 bytes an entry plus its tokens, for a million blocks
/// of 16 tokens. A larger one is not read.
pub(super) const MAX_INDEX_BYTES: u64 = 128 << 20;

/// The bytes of the regular file at `path`, at most `limit` of them: a link, a FIFO, a device,
/// a directory, or a file larger than `limit` is refused (why, in words) without being read.
/// `Ok(None)` where there is no file.
pub(super) fn read_regular(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, String> {
    let file = OpenOptions::new()
        .read(true)
        // A FIFO opened for reading would wait for a writer; a link is not followed (a block
        // or the index linked to /dev/zero or elsewhere is refused here).
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err("a symbolic link, not a regular file".into())
        }
        Err(e) => return Err(e.to_string()),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err(format!("not a regular file ({})", kind(&meta.file_type())));
    }
    if meta.len() > limit {
        return Err(format!(
            "{} bytes, more than the {limit} it may hold",
            meta.len()
        ));
    }
    let mut raw = Vec::with_capacity(meta.len() as usize);
    // Bounded even if the file grows while it is read.
    file.take(limit)
        .read_to_end(&mut raw)
        .map_err(|e| e.to_string())?;
    Ok(Some(raw))
}

/// What a file that is not a regular file is, for the log.
fn kind(t: &fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// Whether `path` is a regular file of exactly `len` bytes (a link is not followed): why
/// not, in words, where it is not.
pub(super) fn regular_of(path: &Path, len: u64) -> Result<(), String> {
    let m = fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    if !m.is_file() {
        return Err(format!("not a regular file ({})", kind(&m.file_type())));
    }
    match m.len() == len {
        true => Ok(()),
        false => Err(format!("{} bytes, not the {len} its entry says", m.len())),
    }
}

/// Removes what is at `path`, whatever it is (a directory with what it holds; a link itself,
/// never what it names): a file the tier refused, so the next start neither pays for it nor
/// finds the name taken.
pub(super) fn remove(path: &Path) {
    let is_dir = fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
    let _ = match is_dir {
        true => fs::remove_dir_all(path),
        false => fs::remove_file(path),
    };
}
