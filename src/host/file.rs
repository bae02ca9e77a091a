//! Files that hold data out of memory: unlinked, so their blocks go back when the last
//! handle closes, whoever holds it and however the process ends.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

/// An unlinked file in `dir`: `O_TMPFILE` where the filesystem has it, else created and
/// removed at once. Its blocks go back when the handle closes.
pub fn unlinked_file(dir: &Path) -> std::io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC;
    match rustix::fs::open(dir, flags, Mode::RUSR | Mode::WUSR) {
        Ok(fd) => Ok(File::from(fd)),
        Err(_) => {
            let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("procmem-swap-{}-{n}", std::process::id()));
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)?;
            std::fs::remove_file(&path)?;
            Ok(file)
        }
    }
}
