//! The tier's files read as a hostile directory may hold them (issue 50): only a regular file
//! is read, opened without following a link and without waiting on a FIFO or a device, its
//! size checked with `fstat` before a byte is read and read no further than that; a file that
//! fails is removed, so the next start does not pay for it again. An error that says nothing
//! of the file (no descriptor or memory left) leaves it where it is.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The most bytes an index may take: 48 bytes an entry plus its tokens, for a million blocks
/// of 16 tokens. A larger one is not read.
pub(super) const MAX_INDEX_BYTES: u64 = 128 << 20;

/// Why a file was not read.
#[derive(Debug)]
pub(super) enum Unread {
    /// Not a file the tier keeps (a link, a FIFO, a directory, another size, torn or altered
    /// bytes): removed by the caller.
    Refused(String),
    /// The OS could not read it now (no descriptor or memory left): left in place, the next
    /// read or start tries again.
    Failed(io::Error),
}

impl fmt::Display for Unread {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unread::Refused(why) => f.write_str(why),
            Unread::Failed(e) => write!(f, "not read now, left in place: {e}"),
        }
    }
}

impl From<String> for Unread {
    fn from(why: String) -> Self {
        Unread::Refused(why)
    }
}

/// Whether `e` says nothing of the file: out of descriptors or memory, or interrupted. (An
/// I/O error says the file is unreadable: it is refused, so it is neither promised again
/// nor kept from being written anew.)
pub(super) fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EINTR | libc::EAGAIN)
    )
}

fn unread(e: io::Error) -> Unread {
    match e.raw_os_error() {
        Some(libc::ELOOP) => Unread::Refused("a symbolic link, not a regular file".into()),
        _ if transient(&e) => Unread::Failed(e),
        _ => Unread::Refused(e.to_string()),
    }
}

/// Opens `path` without following a link or waiting on a FIFO (`create`: for writing, made
/// if missing), and checks it is a regular file.
pub(super) fn open_regular(path: &Path, create: bool) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(!create)
        .write(create)
        .create(create)
        .mode(0o600)
        .truncate(false)
        // A FIFO opened for reading would wait for a writer (for writing, it fails at once);
        // a link, to /dev/zero or anywhere, is not followed.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    let meta = file.metadata()?;
    match meta.is_file() {
        true => Ok(file),
        false => Err(io::Error::other(format!(
            "not a regular file ({})",
            kind(&meta.file_type())
        ))),
    }
}

/// The bytes of the regular file at `path`, at most `limit` of them: a link, a FIFO, a device,
/// a directory, or a file larger than `limit` is refused (why, in words) without being read.
/// `Ok(None)` where there is no file.
pub(super) fn read_regular(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, Unread> {
    let file = match open_regular(path, false) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unread(e)),
    };
    let len = file.metadata().map_err(unread)?.len();
    if len > limit {
        return Err(Unread::Refused(format!(
            "{len} bytes, more than the {limit} it may hold"
        )));
    }
    let mut raw = Vec::with_capacity(len as usize);
    // Bounded even if the file grows while it is read.
    file.take(limit).read_to_end(&mut raw).map_err(unread)?;
    Ok(Some(raw))
}

/// What a file that is not a regular file is, for the log.
pub(super) fn kind(t: &fs::FileType) -> &'static str {
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
/// not, where it is not.
pub(super) fn regular_of(path: &Path, len: u64) -> Result<(), Unread> {
    let m = fs::symlink_metadata(path).map_err(unread)?;
    if !m.is_file() {
        let why = format!("not a regular file ({})", kind(&m.file_type()));
        return Err(Unread::Refused(why));
    }
    match m.len() == len {
        true => Ok(()),
        false => Err(Unread::Refused(format!(
            "{} bytes, not the {len} its entry says",
            m.len()
        ))),
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
