//! Issue 50: the real server's prefix disk tier over a directory an outside hand has damaged.
//! A run of the main job fills the tier; each case starts the job again on a copy of that
//! directory with one thing wrong (a FIFO named like a block, a 2 GB sparse file in a block's
//! place, the index linked to `/dev/zero`, a flipped byte in a block, a FIFO named `LOCK`,
//! `blocks` linked to a directory elsewhere, a full disk) and checks
//! what a user would: the job ends (no hang), every answer is the one a server without the
//! tier gives, the books end at zero, the damage is gone from the directory (so the next start
//! does not pay for it again), and the process never held the damaged file's bytes. The
//! `hostile_disk_tier` row of `scripts/reliability.sh` counts the cases that passed.
#![cfg(target_os = "linux")]

mod common;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The main job on the real model: a few requests of the built-in prompts, which share a
/// system prompt, with every prompt block let down to disk at once.
fn job(disk: Option<&Path>, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--model",
        "smollm2",
        "--requests",
        "4",
        "--concurrency",
        "2",
        "--max-new-tokens",
        "6",
    ]
    .map(String::from)
    .to_vec();
    if let Some(dir) = disk {
        args.extend(["--prefix-disk".into(), dir.display().to_string()]);
        args.extend(["--prefix-disk-min-hits".into(), "1".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Runs `program args` (within 120 s: a start that waits forever on a FIFO fails here), and
/// gives its output.
fn run(program: &Path, args: &[String]) -> Output {
    let mut cmd = Command::new(program);
    // The default filter: the start's one line is checked at it.
    cmd.args(args).env_remove("RUST_LOG");
    let what = format!("{program:?} {args:?}");
    common::output_within(&mut cmd, Duration::from_secs(120), &what)
}

/// The completions section of a run that succeeded with the books at zero.
fn completions(out: &Output, what: &str) -> Result<String, String> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{what}: {:?}\n{stdout}\n{stderr}", out.status));
    }
    if !stdout.contains("books after shutdown: zero") {
        return Err(format!("{what}: the books are not at zero\n{stdout}"));
    }
    let at = stdout
        .find("\ncompletions\n")
        .ok_or(format!("{what}: no completions\n{stdout}"))?;
    Ok(stdout[at..]
        .lines()
        .filter(|l| !l.starts_with("books after"))
        .collect::<Vec<_>>()
        .join("\n"))
}

/// The summary's "disk tier: blocks / in tokens / failed" figures.
fn disk_row(out: &Output) -> [u64; 3] {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with("disk tier: blocks / in tokens / failed")
        })
        .unwrap_or_default();
    let mut figures = line
        .rsplit("failed")
        .next()
        .unwrap_or_default()
        .split('/')
        .map(|f| f.trim().parse().unwrap_or(0));
    [(); 3].map(|()| figures.next().unwrap_or(0))
}

/// The largest resident set of any child waited for so far, in bytes.
fn children_peak_rss() -> u64 {
    // SAFETY: `getrusage` fills the struct it is given; all-zero is a valid value of it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a `rusage`.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    usage.ru_maxrss as u64 * 1024
}

/// A fresh copy of the filled tier.
fn copy_of(filled: &Path, to: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(to);
    let status = Command::new("cp")
        .arg("-a")
        .arg(filled)
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success());
    to.to_path_buf()
}

/// The tier's block files, in name order.
fn blocks(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("blocks"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

fn index_of(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("INDEX-")
        })
        .expect("an index")
}

/// A case: damages the directory, then checks it after the run.
type Case = (
    &'static str,
    fn(&Path) -> PathBuf,
    fn(&Path, &Path, [u64; 3]) -> Result<(), String>,
);

/// Every block file a FIFO.
fn fifo(dir: &Path) -> PathBuf {
    for victim in blocks(dir) {
        std::fs::remove_file(&victim).unwrap();
        mkfifo(&victim);
    }
    dir.join("blocks")
}

/// A FIFO at `path`.
fn mkfifo(path: &Path) {
    let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
}

fn no_fifo_left(_: &Path, blocks_dir: &Path, _: [u64; 3]) -> Result<(), String> {
    match blocks(blocks_dir.parent().unwrap())
        .iter()
        .find(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_fifo()))
    {
        Some(p) => Err(format!("{p:?} is a FIFO still")),
        None => Ok(()),
    }
}

/// Every block file 2 GB, sparse (no disk is used).
fn oversized(dir: &Path) -> PathBuf {
    for victim in blocks(dir) {
        std::fs::File::options()
            .write(true)
            .open(&victim)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
    }
    dir.join("blocks")
}

fn not_oversized(_: &Path, blocks_dir: &Path, _: [u64; 3]) -> Result<(), String> {
    match blocks(blocks_dir.parent().unwrap())
        .iter()
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.len() >= 1 << 30))
    {
        Some(p) => Err(format!("{p:?} is 2 GB still")),
        None => Ok(()),
    }
}

fn index_to_dev_zero(dir: &Path) -> PathBuf {
    let index = index_of(dir);
    std::fs::remove_file(&index).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &index).unwrap();
    index
}

/// The damaged name (the index, `LOCK`) is a regular file again.
fn a_file_again(_: &Path, path: &Path, _: [u64; 3]) -> Result<(), String> {
    let m = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    match m.file_type().is_file() {
        true => Ok(()),
        false => Err(format!("{path:?} is still {:?}", m.file_type())),
    }
}

/// A byte flipped in the middle of every block file (its size unchanged: found at open, and
/// refused when a prompt reads it).
fn flipped_byte(dir: &Path) -> PathBuf {
    for victim in blocks(dir) {
        let mut raw = std::fs::read(&victim).unwrap();
        let mid = raw.len() / 2;
        raw[mid] ^= 0x20;
        std::fs::write(&victim, raw).unwrap();
    }
    dir.join("blocks")
}

/// A prompt met a flipped block (a failed copy in, computed instead), and the answers are the
/// tierless ones (checked for every case).
fn not_the_flipped_bytes(_: &Path, _: &Path, disk: [u64; 3]) -> Result<(), String> {
    match disk[2] {
        0 => Err(format!("no copy in met the damage: {disk:?}")),
        _ => Ok(()),
    }
}

/// A FIFO named `LOCK` (opened for writing, it hung the start).
fn lock_fifo(dir: &Path) -> PathBuf {
    let lock = dir.join("LOCK");
    let _ = std::fs::remove_file(&lock);
    mkfifo(&lock);
    lock
}

/// `blocks` a link to a directory elsewhere, holding the blocks and a file of someone
/// else's whose name holds `.tmp`.
fn blocks_linked_elsewhere(dir: &Path) -> PathBuf {
    let elsewhere = dir.with_extension("elsewhere");
    let _ = std::fs::remove_dir_all(&elsewhere);
    std::fs::rename(dir.join("blocks"), &elsewhere).unwrap();
    std::fs::write(elsewhere.join("notes.tmp.txt"), b"theirs").unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.join("blocks")).unwrap();
    elsewhere
}

fn elsewhere_untouched(dir: &Path, elsewhere: &Path, _: [u64; 3]) -> Result<(), String> {
    let theirs = std::fs::read(elsewhere.join("notes.tmp.txt")).map_err(|e| e.to_string())?;
    let files = std::fs::read_dir(elsewhere)
        .map_err(|e| e.to_string())?
        .count();
    let link = std::fs::symlink_metadata(dir.join("blocks")).map_err(|e| e.to_string())?;
    match (theirs == b"theirs", files > 1, link.is_dir()) {
        (true, true, true) => Ok(()),
        seen => Err(format!(
            "elsewhere changed or blocks not a directory: {seen:?}"
        )),
    }
}

/// Prints `FIGURE hostile_disk_tier passed/7` for `scripts/reliability.sh`; fails if any case
/// that ran failed (a FIFO for `LOCK` and `blocks` linked elsewhere are the two cases a
/// review found after the first five; the full disk needs `unshare -rm` for a tmpfs of its own: where the
/// sandbox refuses it, that case is said skipped and not counted as passed).
#[test]
fn a_damaged_disk_tier_never_hangs_never_reads_the_damage_and_answers_as_without_it() {
    if procmem_model::fetch_smollm2().is_none() {
        eprintln!("SKIPPED: no SmolLM2 GGUF, and scripts/fetch-model.sh could not fetch it");
        return;
    }
    let server = common::example("inference_server");
    let scratch = std::env::temp_dir().join(format!("procmem-hostile-tier-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let plain = completions(&run(&server, &job(None, &[])), "no tier").unwrap();
    let filled = scratch.join("filled");
    let first = completions(&run(&server, &job(Some(&filled), &[])), "filling").unwrap();
    assert_eq!(first, plain, "the tier changes no answer");
    assert!(!blocks(&filled).is_empty(), "the job left blocks on disk");
    // Undamaged, a second run serves prompt tokens from the tier: the cases below meet the
    // damage where it is read.
    let again = run(
        &server,
        &job(Some(&copy_of(&filled, &scratch.join("again"))), &[]),
    );
    assert_eq!(completions(&again, "again").unwrap(), plain);
    let from_disk = disk_row(&again);
    assert!(
        from_disk[1] > 0,
        "no prompt tokens from disk: {from_disk:?}"
    );
    let baseline_rss = children_peak_rss();
    let cases: [Case; 6] = [
        ("a FIFO named like a block", fifo, no_fifo_left),
        ("a 2 GB sparse file for a block", oversized, not_oversized),
        (
            "the index linked to /dev/zero",
            index_to_dev_zero,
            a_file_again,
        ),
        (
            "a flipped byte in a block",
            flipped_byte,
            not_the_flipped_bytes,
        ),
        ("a FIFO named LOCK", lock_fifo, a_file_again),
        (
            "blocks linked to a directory elsewhere",
            blocks_linked_elsewhere,
            elsewhere_untouched,
        ),
    ];
    let (mut passed, mut failures) = (0, Vec::new());
    for (i, (what, damage, check)) in cases.into_iter().enumerate() {
        let dir = copy_of(&filled, &scratch.join(format!("case{i}")));
        let victim = damage(&dir);
        let start = Instant::now();
        let out = run(&server, &job(Some(&dir), &[]));
        let verdict = completions(&out, what)
            .and_then(|c| match c == plain {
                true => Ok(()),
                false => Err(format!("{what}: other answers\n{c}\nagainst\n{plain}")),
            })
            .and_then(|()| check(&dir, &victim, disk_row(&out)).map_err(|e| format!("{what}: {e}")))
            .and_then(|()| {
                // One line at the default level says what the start found.
                let stderr = String::from_utf8_lossy(&out.stderr);
                match stderr
                    .lines()
                    .filter(|l| l.contains("prefix disk tier opened"))
                    .count()
                {
                    1 => Ok(()),
                    n => Err(format!("{what}: {n} open lines\n{stderr}")),
                }
            })
            .and_then(|()| {
                // Reading the damage (2 GB, or /dev/zero until allocation fails) shows here.
                let peak = children_peak_rss();
                match peak < baseline_rss + (512 << 20) {
                    true => Ok(()),
                    false => Err(format!("{what}: a child held {peak} bytes")),
                }
            });
        eprintln!(
            "hostile_disk_tier: {what}: {verdict:?} in {:?}; disk blocks / in tokens / failed {:?}",
            start.elapsed(),
            disk_row(&out)
        );
        match verdict {
            Ok(()) => passed += 1,
            Err(e) => failures.push(e),
        }
    }
    match full_disk(&server, &filled, &scratch.join("full"), &plain) {
        Some(Ok(())) => passed += 1,
        Some(Err(e)) => failures.push(e),
        None => eprintln!("SKIPPED full disk: no tmpfs of its own (unshare -rm refused)"),
    }
    common::figure("hostile_disk_tier", passed, 7);
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The filled tier on a tmpfs with no byte free, its index lost (so the blocks are found by
/// their files and the index must be written again, and cannot be): the job answers as
/// without the tier, and says it serves what it found. `None` where no tmpfs can be mounted.
fn full_disk(
    server: &Path,
    filled: &Path,
    mount: &Path,
    plain: &str,
) -> Option<Result<(), String>> {
    std::fs::create_dir_all(mount).unwrap();
    let args = job(Some(&mount.join("tier")), &[]);
    // Inside a mount namespace of its own: a tmpfs, the tier copied in without its index,
    // the rest filled.
    let script = r#"set -e
mount -t tmpfs -o size="$3" tmpfs "$1"
cp -a "$2" "$1/tier"
rm -f "$1"/tier/INDEX-*
dd if=/dev/zero of="$1/fill" bs=4k 2>/dev/null || true
shift 3
exec "$@""#;
    let held: u64 = blocks(filled)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    let size = (held + (4 << 20)).to_string();
    let probe = Command::new("unshare")
        .args(["-rm", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !probe {
        return None;
    }
    let mut all = vec![
        "-rm".to_string(),
        "sh".into(),
        "-c".into(),
        script.into(),
        "full".into(),
        mount.display().to_string(),
        filled.display().to_string(),
        size,
        server.display().to_string(),
    ];
    all.extend(args);
    let out = run(Path::new("unshare"), &all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    Some(
        completions(&out, "a full disk")
            .and_then(|c| match c == plain {
                true => Ok(()),
                false => Err(format!("a full disk: other answers\n{c}")),
            })
            .and_then(|()| match stderr.contains("serving what it found") {
                true => Ok(()),
                false => Err(format!(
                    "a full disk: no warning naming the index\n{stderr}"
                )),
            }),
    )
}
