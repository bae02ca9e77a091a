//! The serving bench's workload, fixed and seeded: the conversations (a shared system prompt,
//! user messages of 50 to 200 tokens), the long prompts, and the loops that send them.
// Shared by the serving and sharing benches, which each use a part.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use procmem_model::TextCodec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::client::{self, Answer, Msg};

pub const SEED: u64 = 26;
pub const ANSWER_TOKENS: u32 = 64;
pub const LONG_TOKENS: usize = 2000;

const WORDS: &[&str] = &[
    "memory", "garden", "river", "engine", "window", "history", "market", "winter", "science",
    "music", "planet", "language", "kitchen", "bridge", "forest", "number", "question", "teacher",
    "ocean", "mountain", "city", "travel", "letter", "morning", "village", "story", "energy",
    "machine", "animal", "picture", "weather", "island", "doctor", "library", "painting",
    "harvest", "lantern", "harbor", "journey", "silver", "meadow", "castle",
];

/// The `p` quantile (0 to 1) of `v`, nearest rank (sorts `v`); NaN where empty.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Text of at least `tokens` tokens (and a few more at most), from seeded words.
pub fn text_of(codec: &TextCodec, rng: &mut StdRng, head: &str, tokens: usize) -> String {
    let mut text = head.to_string();
    loop {
        for _ in 0..8 {
            text.push(' ');
            text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        }
        text.push('.');
        if codec.encode(&text).map_or(0, |t| t.len()) >= tokens {
            return text;
        }
    }
}

pub struct Workload {
    pub system: String,
    /// Each conversation's user messages.
    pub conversations: Vec<Vec<String>>,
    pub long: Vec<String>,
    /// Tokens a sequence of the workload holds at most (prompt and answer), rounded up.
    pub context: usize,
}

pub fn workload(codec: &TextCodec) -> Workload {
    let mut rng = StdRng::seed_from_u64(SEED);
    let system = text_of(
        codec,
        &mut rng,
        "You are a patient assistant. Answer in plain words, briefly. Context for every answer:",
        300,
    );
    let turns = env_usize("PROCMEM_BENCH_TURNS", 4);
    let conversations: Vec<Vec<String>> = (0..env_usize("PROCMEM_BENCH_CONVERSATIONS", 32))
        .map(|c| {
            (0..turns)
                .map(|t| {
                    let n = rng.random_range(50..=200);
                    text_of(
                        codec,
                        &mut rng,
                        &format!("Conversation {c}, turn {t}: tell me about"),
                        n,
                    )
                })
                .collect()
        })
        .collect();
    let long = (0..env_usize("PROCMEM_BENCH_LONG", 8))
        .map(|i| {
            text_of(
                codec,
                &mut rng,
                &format!("Document {i}. Summarize it:"),
                LONG_TOKENS,
            )
        })
        .collect();
    // The longest conversation's last turn, with every answer at its longest (and the chat
    // template's few tokens per message).
    let longest = conversations
        .iter()
        .map(|turns| {
            let mut msgs = vec![("system", system.as_str())];
            for u in turns {
                msgs.push(("user", u.as_str()));
            }
            codec.chat_messages(&msgs).map_or(0, |t| t.len())
                + turns.len() * (ANSWER_TOKENS as usize + 8)
        })
        .max()
        .unwrap_or(0);
    Workload {
        system,
        conversations,
        long,
        context: longest.next_multiple_of(256),
    }
}

/// What one row's requests gave, keyed by (conversation, turn).
pub type Answers = Vec<((usize, usize), Result<Answer, String>)>;

/// Runs every conversation, `concurrency` at once (closed loop) or starting at Poisson arrivals
/// of `rate` a second (open loop).
pub async fn conversations(
    addr: SocketAddr,
    w: &Workload,
    concurrency: usize,
    rate: Option<f64>,
) -> Answers {
    let next = Arc::new(AtomicUsize::new(0));
    let n = w.conversations.len();
    let convs = Arc::new(w.conversations.clone());
    let system = Arc::new(w.system.clone());
    let one = move |c: usize| {
        let convs = Arc::clone(&convs);
        let system = Arc::clone(&system);
        async move {
            conversation(addr, &system, &convs[c])
                .await
                .into_iter()
                .enumerate()
                .map(|(t, a)| ((c, t), a))
                .collect::<Vec<_>>()
        }
    };
    let mut tasks = Vec::new();
    match rate {
        None => {
            for _ in 0..concurrency.max(1) {
                let next = Arc::clone(&next);
                let one = one.clone();
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let c = next.fetch_add(1, Ordering::Relaxed);
                        if c >= n {
                            return out;
                        }
                        out.extend(one(c).await);
                    }
                }));
            }
        }
        Some(rate) => {
            let mut rng = StdRng::seed_from_u64(SEED + 1);
            for c in 0..n {
                tasks.push(tokio::spawn(one(c)));
                let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
                tokio::time::sleep(Duration::from_secs_f64(-u.ln() / rate)).await;
            }
        }
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    all.sort_by_key(|(k, _)| *k);
    all
}

/// One conversation: `system`, then each of `turns` with the answers so far, a turn sent once
/// the previous answer has arrived; the answers, up to the first that failed.
pub async fn conversation(
    addr: SocketAddr,
    system: &str,
    turns: &[String],
) -> Vec<Result<Answer, String>> {
    let mut msgs = vec![Msg {
        role: "system",
        content: system.to_string(),
    }];
    let mut out = Vec::new();
    for user in turns {
        msgs.push(Msg {
            role: "user",
            content: user.clone(),
        });
        let a = client::chat(addr, &msgs, ANSWER_TOKENS).await;
        let text = a.as_ref().map(|a| a.text.clone()).unwrap_or_default();
        let failed = a.is_err();
        out.push(a);
        if failed {
            break;
        }
        msgs.push(Msg {
            role: "assistant",
            content: text,
        });
    }
    out
}

/// The `long` prompts, `concurrency` at once.
pub async fn long_prompts(addr: SocketAddr, w: &Workload, concurrency: usize) -> Answers {
    let next = Arc::new(AtomicUsize::new(0));
    let long = Arc::new(w.long.clone());
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (next, long) = (Arc::clone(&next), Arc::clone(&long));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= long.len() {
                    return out;
                }
                let msgs = [Msg {
                    role: "user",
                    content: long[i].clone(),
                }];
                out.push(((i, 0), client::chat(addr, &msgs, ANSWER_TOKENS).await));
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    all.sort_by_key(|(k, _)| *k);
    all
}
