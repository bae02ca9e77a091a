//! A procmem server as the serving and sharing benches run it, in a child process of the
//! bench binary: the library's launch (`procmem_model::launch`) and server
//! (`procmem_model::http::serve_model`), listening until SIGTERM, printing the lines the
//! parent reads (the budget, the address, the books at shutdown).

use std::process::ExitCode;
use std::time::Duration;

use procmem_actors::MemoryManager;
use procmem_model::http::{serve_bound, Limits, ServeConfig, Server};
use procmem_model::launch::{join_node, KvSlot, Launch, ModelConfig, NodeJoin};

/// How the child serves `config`'s model: on `127.0.0.1:0`, `running` at once, answers of
/// `answer_tokens` unless asked otherwise.
pub fn serve_config(running: usize, answer_tokens: usize) -> ServeConfig {
    ServeConfig {
        addr: ([127, 0, 0, 1], 0).into(),
        model_name: "smollm2-135m-instruct".into(),
        max_waiting: 4096,
        max_running: running,
        default_max_tokens: answer_tokens,
        grace: Duration::from_secs(10),
        limits: Limits::default(),
    }
}

/// Serves `config`'s model with `serve` until SIGTERM, joining the node where `join` says.
pub fn serve(config: ModelConfig, serve: ServeConfig, join: Option<NodeJoin>) -> ExitCode {
    // As the main job: freed large buffers leave the process.
    procmem_actors::procmem::host::heap::return_large_frees();
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match rt.block_on(run(config, serve, join)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    config: ModelConfig,
    serve: ServeConfig,
    join: Option<NodeJoin>,
) -> Result<(), String> {
    let launch = Launch::load(&config).map_err(|e| e.to_string())?;
    let s = launch.sizing;
    println!(
        "budget {} bytes: weights {} + peak KV demand {}",
        s.budget, s.weights, s.peak_kv
    );
    // Bound before the node is joined: a server that cannot listen takes no credit.
    let server = Server::bind(serve).await.map_err(|e| e.to_string())?;
    let memory = MemoryManager::builder()
        .host_budget(s.budget)
        .keep_metrics(true)
        .build()
        .await
        .map_err(|e| e.to_string())?;
    let slot = KvSlot::default();
    let link = match &join {
        Some(j) => {
            let model = (config.model.node_name(), std::sync::Arc::clone(&slot));
            Some(
                join_node(&memory, j, false, model)
                    .await
                    .map_err(|e| e.to_string())?,
            )
        }
        None => None,
    };
    let served = match launch.start(&memory).await {
        Ok(started) => {
            let _ = slot.set(started.engine.kv.clone());
            serve_bound(server, started, &memory, None, |addr| {
                println!("listening on http://{addr}")
            })
            .await
            .map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    };
    let report = memory.shutdown().await.map_err(|e| e.to_string())?;
    if let Some(link) = link {
        link.leave().await;
    }
    let stats = served?;
    println!(
        "served {} requests, {} preemptions",
        stats.accepted, stats.preemptions
    );
    if report.is_zero() {
        println!("books after shutdown: zero");
    }
    Ok(())
}
