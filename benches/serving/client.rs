//! The load generator's client: one chat completion, streamed, over HTTP/1.1 (hyper), with
//! the times each piece of text arrived and the usage the server reported.
// Shared by the serving and sharing benches, which each use a part.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// One chat message.
#[derive(Clone, Debug)]
pub struct Msg {
    pub role: &'static str,
    pub content: String,
}

/// What one request gave.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    pub text: String,
    /// From sending to the first piece of text.
    pub first: Option<Duration>,
    /// Between pieces of text after the first.
    pub gaps: Vec<Duration>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
    pub finish: String,
}

/// Posts a streamed greedy chat completion of `max_tokens` and reads it to `[DONE]`.
pub async fn chat(addr: SocketAddr, messages: &[Msg], max_tokens: u32) -> Result<Answer, String> {
    let body = json!({
        "model": "smollm2",
        "messages": messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect::<Vec<_>>(),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "cache_prompt": true,
    });
    let start = Instant::now();
    let req = hyper::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = send(addr, req).await?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
    }
    let mut answer = Answer::default();
    let mut last: Option<Instant> = None;
    let mut buf: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for line in event.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return finished(answer);
                }
                let v: Value =
                    serde_json::from_str(data).map_err(|e| format!("bad event {data}: {e}"))?;
                // A request that failed mid-stream ends with an error object, then [DONE]:
                // its text so far is not an answer.
                if let Some(e) = v.get("error") {
                    return Err(format!("failed mid-stream after {:?}: {e}", answer.text));
                }
                let now = Instant::now();
                if let Some(piece) = v["choices"][0]["delta"]["content"].as_str() {
                    if !piece.is_empty() {
                        match last {
                            None => answer.first = Some(now - start),
                            Some(l) => answer.gaps.push(now - l),
                        }
                        last = Some(now);
                        answer.text.push_str(piece);
                    }
                }
                if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                    answer.finish = f.to_string();
                }
                usage(&v, &mut answer);
            }
        }
    }
    Err("the stream ended without [DONE]".into())
}

fn finished(answer: Answer) -> Result<Answer, String> {
    if answer.first.is_none() && answer.completion_tokens > 0 {
        return Err("tokens counted but no text came".into());
    }
    Ok(answer)
}

/// The usage figures, in the OpenAI shape (procmem, and llama.cpp's last chunk) and in
/// llama.cpp's own `timings` (`cache_n`: prompt tokens taken from its slot's cache).
fn usage(v: &Value, a: &mut Answer) {
    let u = &v["usage"];
    if let Some(p) = u["prompt_tokens"].as_u64() {
        a.prompt_tokens = p;
    }
    if let Some(c) = u["completion_tokens"].as_u64() {
        a.completion_tokens = c;
    }
    if let Some(c) = u["prompt_tokens_details"]["cached_tokens"].as_u64() {
        a.cached_tokens = c;
    }
    if let Some(c) = v["timings"]["cache_n"].as_u64() {
        a.cached_tokens = c;
    }
}

/// Sends `req` to `addr` on a connection of its own (Nagle off: streamed pieces are small).
async fn send(
    addr: SocketAddr,
    mut req: hyper::Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let host = addr.to_string().parse().map_err(|e| format!("host: {e}"))?;
    req.headers_mut().insert(hyper::header::HOST, host);
    sender
        .send_request(req)
        .await
        .map_err(|e| format!("send: {e}"))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `GET path`, the body as text.
pub async fn get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let req = hyper::Request::get(path)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = send(addr, req).await?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("{path}: {status}"));
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// A Prometheus text exposition's value of `name`, summed over its series (labels ignored).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}
