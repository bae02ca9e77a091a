//! The model fetch as library code (issue 59, 2): into an empty cache directory, with no
//! script, checked against the hashes pinned in the crate; a file of the wrong size there is
//! replaced, and a fetch that finds the file does nothing.

use procmem_model::{fetch_smollm2_into, FetchError, SMOLLM2_BYTES, SMOLLM2_FILE};

#[test]
fn the_library_fetches_the_model_into_an_empty_cache() {
    let dir = std::env::temp_dir().join(format!("procmem-fetch-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A wrong file where the model goes: not taken for it.
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(SMOLLM2_FILE), b"GGUF and nothing else").unwrap();
    let path = match fetch_smollm2_into(&dir) {
        Ok(path) => path,
        Err(FetchError::Python(why)) => {
            eprintln!("SKIPPED: no Python or no registry here: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(path, dir.join(SMOLLM2_FILE));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), SMOLLM2_BYTES);
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [SMOLLM2_FILE], "no scratch left behind");
    // Found: nothing is fetched (the file is not rewritten).
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    assert_eq!(fetch_smollm2_into(&dir).unwrap(), path);
    assert_eq!(
        std::fs::metadata(&path).unwrap().modified().unwrap(),
        modified
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
