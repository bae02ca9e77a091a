//! Hostile GGUF files: every variant of a valid tiny llama GGUF with one field changed (a
//! length or count of `u64::MAX`, nesting 100,000 deep, an alignment of 0, a tensor past the
//! end or of a zero dimension, hyper-parameters that overflow, an empty vocabulary) is refused
//! with a typed error by the loader and the tokenizer; none panics, aborts or loads.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use procmem_actors::kv::PreemptMode;
use procmem_fixture as fixture;
use procmem_model::gguf::{Gguf, GgufError};
use procmem_model::{Engine, ModelError, Request, Smol, TextCodec};

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn load(path: &std::path::Path) -> Result<(std::sync::Arc<Smol>, TextCodec), ModelError> {
    let loaded = Smol::load(path)?;
    let codec = TextCodec::new(&loaded.tokenizer)?;
    Ok((loaded.model, codec))
}

#[test]
fn the_tiny_model_loads_and_every_hostile_variant_is_refused() {
    let dir = tempdir();
    let valid = write(&dir, "valid", &fixture::tiny_llama());
    let (model, codec) = load(&valid).expect("the valid tiny model loads");
    assert_eq!(model.config.layers, fixture::LAYERS as usize);
    assert!(!codec.chat(None, "the tea").unwrap().is_empty());

    let variants = fixture::hostile();
    let mut refused = 0;
    let mut failures = Vec::new();
    for (name, bytes) in &variants {
        let path = write(&dir, name, bytes);
        match catch_unwind(AssertUnwindSafe(|| load(&path))) {
            Ok(Err(e)) => {
                refused += 1;
                eprintln!("{name}: {e}");
            }
            Ok(Ok(_)) => failures.push(format!("{name}: loaded")),
            Err(_) => failures.push(format!("{name}: panicked")),
        }
    }
    common::figure("hostile_gguf_loader", refused, variants.len());
    assert!(variants.len() >= 58, "{} variants", variants.len());
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn typed_errors_name_what_failed() {
    let dir = tempdir();
    let by_name: std::collections::HashMap<_, _> = fixture::hostile().into_iter().collect();
    let open = |name: &str| Gguf::open(&write(&dir, name, &by_name[name])).err();
    assert!(matches!(
        open("string_length_max"),
        Some(ModelError::Gguf(GgufError::TooLarge { .. }))
    ));
    assert!(matches!(
        open("array_count_max"),
        Some(ModelError::Gguf(GgufError::Truncated { .. }))
    ));
    assert!(matches!(
        open("nested_100000"),
        Some(ModelError::Gguf(GgufError::Nesting { .. }))
    ));
    assert!(matches!(
        open("alignment_0"),
        Some(ModelError::Gguf(GgufError::Alignment(0)))
    ));
    assert!(matches!(
        open("tensor_offset_past_end"),
        Some(ModelError::Gguf(GgufError::TensorRange { .. }))
    ));
    // u64::MAX is not a multiple of the alignment: refused before its range is computed.
    assert!(matches!(
        open("tensor_offset_max"),
        Some(ModelError::Gguf(GgufError::Tensor { .. }))
    ));
    assert!(matches!(
        open("tensor_dim_0"),
        Some(ModelError::Gguf(GgufError::Tensor { .. }))
    ));
    let config = |name: &str| {
        Gguf::open(&write(&dir, name, &by_name[name]))
            .and_then(|g| g.config())
            .err()
    };
    assert!(matches!(
        config("block_count_max"),
        Some(ModelError::Gguf(GgufError::TooLarge { .. }))
    ));
    assert!(matches!(
        config("head_count_kv_3"),
        Some(ModelError::Gguf(GgufError::Inconsistent(_)))
    ));
}

/// The tiny model decodes through the engine; an empty prompt is refused, not a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tiny_model_decodes_and_an_empty_prompt_is_refused() {
    let dir = tempdir();
    let path = write(&dir, "valid", &fixture::tiny_llama());
    let memory = procmem_actors::MemoryManager::builder()
        .build()
        .await
        .unwrap();
    // A store configured for other heads than the model's is refused before it starts.
    let loaded = Smol::load(&path).unwrap();
    let mut wrong = common::kv_config(&loaded, PreemptMode::Recompute);
    wrong.shape.kv_heads += 1;
    let refused = Engine::start(&memory, loaded, wrong, None).await;
    assert!(
        matches!(refused, Err(ModelError::KvShape { .. })),
        "{:?}",
        refused.err()
    );
    let loaded = Smol::load(&path).unwrap();
    let kv = common::kv_config(&loaded, PreemptMode::Recompute);
    let engine = Engine::start(&memory, loaded, kv, None).await.unwrap();
    let empty = engine
        .generate(
            vec![Request {
                id: 1,
                prompt: Vec::new(),
                max_new: 4,
            }],
            1,
            false,
        )
        .await;
    assert!(
        matches!(empty, Err(ModelError::EmptyPrompt(1))),
        "{empty:?}"
    );
    let (done, _) = engine
        .generate(
            vec![Request {
                id: 2,
                prompt: vec![5, 6, 7],
                max_new: 4,
            }],
            1,
            false,
        )
        .await
        .unwrap();
    assert_eq!(done[0].tokens.len(), 4);
}

/// Our reader and candle's agree on the real file: every tensor's type, shape and place.
#[test]
fn the_reader_agrees_with_candle_on_smollm2() {
    let Some(path) = procmem_model::smollm2_path() else {
        eprintln!("SKIPPED: no SmolLM2 GGUF (scripts/fetch-model.sh)");
        return;
    };
    let ours = Gguf::open(&path).unwrap();
    let mut file = std::fs::File::open(&path).unwrap();
    let theirs = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    assert_eq!(ours.tensor_count(), theirs.tensor_infos.len());
    for (name, info) in &theirs.tensor_infos {
        let t = ours.tensor(name).unwrap();
        assert_eq!(t.dims, info.shape.dims(), "{name}");
        assert_eq!(t.dtype, info.ggml_dtype, "{name}");
        assert_eq!(t.start, theirs.tensor_data_offset + info.offset, "{name}");
    }
    ours.config().unwrap();
    assert_eq!(
        ours.tokenizer().unwrap().tokens.len(),
        ours.config().unwrap().vocab
    );
}

fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "procmem-hostile-gguf-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
