//! Standing credit: taken without messages, topped up in chunks, taken back before any holder
//! is asked to evict, returned when its line closes or its holder dies, kept across a restart.

use super::*;

async fn line(g: &GovernorHandle, h: HolderId, chunk: u64) -> CreditLine {
    g.open_credit(h, MemoryRole::KvCache, chunk).await.unwrap()
}

/// `(provisional, leased, credit, credit_unused)` with the books checked.
async fn credit(g: &GovernorHandle) -> (u64, u64, u64, u64) {
    let s = g.snapshot().await.unwrap();
    (
        s.books.provisional,
        s.books.leased,
        s.books.credit,
        s.credit_unused,
    )
}

#[tokio::test(start_paused = true)]
async fn grants_within_credit_take_no_message_and_change_no_books() {
    let g = governor(10_000).await;
    let h = g.register_holder("kv", 0, None).await.unwrap();
    let l = line(&g, h, 1000).await;
    assert!(l.take(1).is_none(), "a new line is empty");
    let first = l.reserve(100, 0, None).await.unwrap();
    assert_eq!(first.bytes(), 100);
    assert_eq!(
        credit(&g).await,
        (0, 1000, 1000, 900),
        "topped up by a chunk"
    );
    let before = g.snapshot().await.unwrap();
    let mut parts = Vec::new();
    for _ in 0..900 {
        parts.push(l.take(1).expect("within credit"));
    }
    assert!(l.take(1).is_none(), "credit spent");
    assert_eq!(l.unused(), 0);
    drop(parts);
    assert_eq!(l.unused(), 900, "dropped parts went back to the line");
    let after = g.snapshot().await.unwrap();
    assert_eq!(
        (after.grants, after.books.leased),
        (before.grants, before.books.leased),
        "no grant asked, no books changed"
    );
    drop(first);
    l.close();
    assert_eq!(credit(&g).await, (0, 0, 0, 0), "closed: everything back");
}

#[tokio::test(start_paused = true)]
async fn a_closed_line_returns_unused_now_and_used_bytes_as_they_are_released() {
    let g = governor(10_000).await;
    let h = g.register_holder("kv", 0, None).await.unwrap();
    let l = line(&g, h, 1000).await;
    let mut used = l.reserve(300, 0, None).await.unwrap();
    drop(l);
    assert_eq!(credit(&g).await, (0, 300, 0, 0), "700 unused went back");
    used.release(100).unwrap();
    assert_eq!(
        credit(&g).await,
        (0, 200, 0, 0),
        "after close, releases reach the Governor"
    );
    drop(used);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn unused_credit_goes_back_before_any_holder_is_asked() {
    let g = governor(1000).await;
    let (cache, cache_actor) = holder(&g, "cache", 0, Behavior::FreeAll, 0).await;
    let l = line(&g, cache, 600).await;
    let held = l.reserve(100, 0, None).await.unwrap();
    assert_eq!(credit(&g).await, (0, 600, 600, 500));
    let me = g.register_holder("requester", 9, None).await.unwrap();
    // 400 free + 500 unused credit: 800 fits without asking anyone to evict.
    let grant = g
        .reserve(request(me, 800, 1, Some(Duration::from_secs(1))))
        .await
        .unwrap();
    assert_eq!(grant.bytes(), 800);
    assert!(
        seen(&cache_actor).await.is_empty(),
        "no ticket: credit came first"
    );
    let s = g.snapshot().await.unwrap();
    assert_eq!((s.tickets_sent, s.credit_reclaimed), (0, 400));
    assert_eq!(l.unused(), 100, "only the shortfall was taken");
    // A no-wait request takes back the rest the same way.
    drop(grant);
    let me2 = g.register_holder("other", 9, None).await.unwrap();
    let all = g.reserve(request(me2, 900, 1, None)).await.unwrap();
    assert_eq!((all.bytes(), l.unused()), (900, 0));
    drop(all);
    drop(held);
    assert_eq!(l.unused(), 100, "the used part went back to the line");
    drop(l);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn pressure_reaches_holders_only_for_what_credit_cannot_cover() {
    let g = governor(1000).await;
    let (cache, cache_actor) = holder(&g, "cache", 0, Behavior::FreeAll, 500).await;
    let l = line(&g, cache, 300).await;
    let _used = l.reserve(100, 0, None).await.unwrap();
    // Free 200, unused 200, the holder's lease 500: 700 needs 300 from the holder.
    let me = g.register_holder("requester", 9, None).await.unwrap();
    let grant = g
        .reserve(request(me, 700, 1, Some(Duration::from_secs(1))))
        .await
        .unwrap();
    assert_eq!(grant.bytes(), 700);
    let tickets = seen(&cache_actor).await;
    assert_eq!(tickets.len(), 1);
    assert_eq!(
        tickets[0].0, 300,
        "the ticket asks only for what credit did not cover"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dead_holders_lines_close_and_its_unused_credit_returns() {
    let g = governor(1000).await;
    let (h, actor) = holder(&g, "cache", 0, Behavior::Nothing, 0).await;
    let l = line(&g, h, 800).await;
    let used = l.reserve(100, 0, None).await.unwrap();
    actor.kill();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        credit(&g).await,
        (0, 100, 0, 0),
        "700 unused returned at its death"
    );
    assert!(l.take(1).is_none(), "the line is closed");
    drop(used);
    drop(l);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn hostile_sizes_and_handles_are_refused_without_changing_the_books() {
    let g = governor(u64::MAX).await;
    let h = g.register_holder("kv", 0, None).await.unwrap();
    assert!(
        g.open_credit(h, MemoryRole::KvCache, 0).await.is_err(),
        "chunk 0"
    );
    let other = governor(1000).await;
    let foreign = other.register_holder("x", 0, None).await.unwrap();
    assert!(
        g.open_credit(foreign, MemoryRole::KvCache, 10)
            .await
            .is_err(),
        "a holder of another Governor"
    );
    let l = line(&g, h, u64::MAX).await;
    assert!(l.take(0).is_none() && l.take(u64::MAX).is_none());
    assert!(l.reserve(0, 0, None).await.is_err());
    // A chunk past what a line can count is capped; a request past it is an ordinary lease.
    let big = l.reserve(MAX_CREDIT + 1, 0, None).await.unwrap();
    assert_eq!(big.bytes(), MAX_CREDIT + 1);
    assert_eq!(l.unused(), 0);
    drop(big);
    let most = l.reserve(MAX_CREDIT, 0, None).await.unwrap();
    assert_eq!((most.bytes(), l.unused()), (MAX_CREDIT, 0));
    drop(most);
    assert_eq!(l.unused(), MAX_CREDIT);
    let s = g.snapshot().await.unwrap();
    assert_eq!((s.books.leased, s.books.credit), (MAX_CREDIT, MAX_CREDIT));
    drop(l);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn concurrent_reserves_on_one_line_keep_the_books_exact() {
    let g = governor(1 << 20).await;
    let h = g.register_holder("kv", 0, None).await.unwrap();
    let l = std::sync::Arc::new(line(&g, h, 4096).await);
    let tasks: Vec<_> = (0..64u64)
        .map(|i| {
            let l = std::sync::Arc::clone(&l);
            tokio::spawn(async move { l.reserve(100 + i, 0, None).await.unwrap() })
        })
        .collect();
    let mut held = 0;
    let mut leases = Vec::new();
    for t in tasks {
        let lease = t.await.unwrap();
        held += lease.bytes();
        leases.push(lease);
    }
    let (p, leased, credit_bytes, unused) = credit(&g).await;
    assert_eq!((p, leased), (0, credit_bytes));
    assert_eq!(
        credit_bytes,
        held + unused,
        "used + unused = what was approved to the line"
    );
    drop(leases);
    drop(l);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}

#[tokio::test]
async fn a_restarted_governor_keeps_credit_lines_and_their_bytes() {
    let (g, _sup) = GovernorHandle::spawn_supervised(GovernorConfig::new("restart", 10_000))
        .await
        .unwrap();
    let h = g.register_holder("kv", 0, None).await.unwrap();
    let l = line(&g, h, 1000).await;
    let used = l.reserve(250, 0, None).await.unwrap();
    let before = g.actor().get_id();
    g.actor().kill();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while g.actor().get_id() == before {
        assert!(std::time::Instant::now() < deadline, "not restarted");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        credit(&g).await,
        (0, 1000, 1000, 750),
        "rebuilt with the line"
    );
    // The line still works against the new Governor: top-up, reclaim, close.
    let more = l.reserve(1000, 0, None).await.unwrap();
    assert_eq!(credit(&g).await, (0, 2000, 2000, 750));
    drop(more);
    drop(used);
    drop(l);
    assert_eq!(credit(&g).await, (0, 0, 0, 0));
}
