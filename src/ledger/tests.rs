use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn setup(capacity: u64) -> (Ledger, AuthorityId, HolderId, HolderId) {
    let mut l = Ledger::new();
    let a = l.add_authority("gpu0", capacity);
    let kv = l.register_holder(a, "kv", 1).unwrap();
    let w = l.register_holder(a, "weights", 5).unwrap();
    (l, a, kv, w)
}

#[test]
fn reserve_commit_release_round_trip() {
    let (mut l, a, kv, _) = setup(1000);
    let g = l.reserve(kv, a, MemoryRole::KvCache, 400).unwrap();
    assert_eq!(l.snapshot(a).unwrap().provisional, 400);
    let lease = l.commit(kv, g.id, 300).unwrap();
    let s = l.snapshot(a).unwrap();
    assert_eq!(
        (s.provisional, s.leased),
        (0, 300),
        "a smaller footprint refunds"
    );
    assert_eq!(l.release(kv, lease.id, 100).unwrap(), 200);
    assert_eq!(l.release(kv, lease.id, 200).unwrap(), 0);
    assert_eq!(l.snapshot(a).unwrap().approved(), 0);
    assert_eq!(
        l.release(kv, lease.id, 1),
        Err(LedgerError::UnknownLease(lease.id))
    );
    l.check_invariants().unwrap();
}

#[test]
fn commit_tops_up_only_if_there_is_room() {
    let (mut l, a, kv, w) = setup(1000);
    let g = l.reserve(kv, a, MemoryRole::KvCache, 400).unwrap();
    let _other = l.reserve(w, a, MemoryRole::Weights, 500).unwrap();
    let before = l.snapshot(a).unwrap();
    match l.commit(kv, g.id, 600) {
        Err(LedgerError::Denied(d)) => {
            assert!(d.during_commit);
            assert_eq!((d.asked, d.free()), (200, 100));
        }
        other => panic!("expected a denial, got {other:?}"),
    }
    assert_eq!(l.snapshot(a).unwrap(), before, "the grant stays as it was");
    let lease = l.commit(kv, g.id, 500).unwrap();
    assert_eq!(lease.claim.bytes, 500);
    assert_eq!(l.snapshot(a).unwrap().approved(), 1000);
    l.check_invariants().unwrap();
}

#[test]
fn denial_names_what_is_free_and_the_largest_holders() {
    let (mut l, a, kv, w) = setup(1000);
    let g = l.reserve(w, a, MemoryRole::Weights, 700).unwrap();
    l.commit(w, g.id, 700).unwrap();
    l.reserve(kv, a, MemoryRole::KvCache, 200).unwrap();
    let err = l.reserve(kv, a, MemoryRole::KvCache, 300).unwrap_err();
    let LedgerError::Denied(d) = &err else {
        panic!("{err:?}")
    };
    assert_eq!((d.asked, d.free(), d.capacity), (300, 100, 1000));
    let names: Vec<_> = d
        .top_holders
        .iter()
        .map(|h| (h.name.as_str(), h.total()))
        .collect();
    assert_eq!(names, vec![("weights", 700), ("kv", 200)]);
    let text = err.to_string();
    assert!(
        text.contains("asked 300 bytes")
            && text.contains("100 free")
            && text.contains("weights 700"),
        "{text}"
    );
}

#[test]
fn grants_and_leases_cannot_be_forged_shared_or_replayed() {
    let (mut l, a, kv, w) = setup(1000);
    let (mut other, oa, oh, _) = setup(1000);
    let foreign = other.reserve(oh, oa, MemoryRole::KvCache, 10).unwrap();
    let g = l.reserve(kv, a, MemoryRole::KvCache, 100).unwrap();
    let before = l.clone().snapshot(a).unwrap();
    assert_eq!(
        l.commit(kv, foreign.id, 10),
        Err(LedgerError::UnknownGrant(foreign.id))
    );
    assert_eq!(
        l.cancel(kv, foreign.id),
        Err(LedgerError::UnknownGrant(foreign.id))
    );
    assert_eq!(
        l.commit(w, g.id, 100),
        Err(LedgerError::NotYours {
            owner: kv,
            caller: w
        })
    );
    assert_eq!(
        l.cancel(w, g.id),
        Err(LedgerError::NotYours {
            owner: kv,
            caller: w
        })
    );
    assert_eq!(l.snapshot(a).unwrap(), before);
    let lease = l.commit(kv, g.id, 100).unwrap();
    assert_eq!(
        l.commit(kv, g.id, 100),
        Err(LedgerError::UnknownGrant(g.id)),
        "committed twice"
    );
    assert_eq!(l.cancel(kv, g.id), Err(LedgerError::UnknownGrant(g.id)));
    assert_eq!(
        l.release(w, lease.id, 100),
        Err(LedgerError::NotYours {
            owner: kv,
            caller: w
        })
    );
    assert!(matches!(
        l.release(kv, lease.id, 101),
        Err(LedgerError::ReleaseExceedsLease { .. })
    ));
    assert_eq!(l.release(kv, lease.id, 0), Err(LedgerError::ZeroBytes));
    l.release(kv, lease.id, 100).unwrap();
    assert_eq!(
        l.release(kv, lease.id, 100),
        Err(LedgerError::UnknownLease(lease.id)),
        "released twice"
    );
    assert_eq!(
        l.reserve(oh, a, MemoryRole::KvCache, 1),
        Err(LedgerError::UnknownHolder(oh))
    );
    l.check_invariants().unwrap();
}

#[test]
fn lowering_capacity_takes_nothing_back() {
    let (mut l, a, kv, _) = setup(1000);
    let g = l.reserve(kv, a, MemoryRole::KvCache, 800).unwrap();
    let lease = l.commit(kv, g.id, 800).unwrap();
    l.set_capacity(a, 500).unwrap();
    let s = l.snapshot(a).unwrap();
    assert_eq!((s.leased, s.free()), (800, 0));
    assert!(matches!(
        l.reserve(kv, a, MemoryRole::KvCache, 1),
        Err(LedgerError::Denied(_))
    ));
    assert_eq!(l.shortfall(a, 100).unwrap(), 400);
    l.release(kv, lease.id, 400).unwrap();
    assert!(l.reserve(kv, a, MemoryRole::KvCache, 100).is_ok());
    assert!(l.within_capacity(a));
}

#[test]
fn retiring_returns_grants_at_once_and_keeps_leases_until_freed() {
    let (mut l, a, kv, _) = setup(1000);
    let g1 = l.reserve(kv, a, MemoryRole::KvCache, 100).unwrap();
    let g2 = l.reserve(kv, a, MemoryRole::KvCache, 200).unwrap();
    let lease = l.commit(kv, g1.id, 100).unwrap();
    let retired = l.retire_holder(kv).unwrap();
    assert_eq!(retired.grants_returned, vec![(g2.id, 200)]);
    assert_eq!(retired.leased_outstanding, 100);
    assert_eq!(l.snapshot(a).unwrap().approved(), 100);
    assert_eq!(
        l.reserve(kv, a, MemoryRole::KvCache, 1),
        Err(LedgerError::HolderRetired(kv))
    );
    l.release(kv, lease.id, 100).unwrap();
    assert_eq!(l.holder(kv), None, "forgotten once nothing is left");
    l.check_invariants().unwrap();
}

#[test]
fn aliased_tiers_share_one_authority() {
    let mut l = Ledger::new();
    let unified = l.add_authority("unified", 100);
    l.bind_tier(Place::HOST, MemoryTier::Host, unified).unwrap();
    l.bind_tier(Place::cuda(0), MemoryTier::Device, unified)
        .unwrap();
    assert_eq!(
        l.authority_for(Place::cuda(0), MemoryTier::Device),
        Some(unified)
    );
    assert_eq!(
        l.authority_for(Place::HOST, MemoryTier::Host),
        Some(unified)
    );
    let other = l.add_authority("other", 100);
    assert!(matches!(
        l.bind_tier(Place::HOST, MemoryTier::Host, other),
        Err(LedgerError::TierAlreadyBound { .. })
    ));
    let h = l.register_holder(unified, "kv", 0).unwrap();
    l.reserve(h, unified, MemoryRole::KvCache, 60).unwrap();
    assert!(matches!(
        l.reserve(h, unified, MemoryRole::Weights, 60),
        Err(LedgerError::Denied(_))
    ));
}

// ---- model-based property test ----

const HOLDERS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    Reserve { h: usize, bytes: u64 },
    Commit { g: usize, as_h: usize, actual: u64 },
    Cancel { g: usize, as_h: usize },
    Release { l: usize, as_h: usize, bytes: u64 },
    SetCapacity { capacity: u64 },
    Retire { h: usize },
    Forged { bytes: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..HOLDERS, 0..400u64).prop_map(|(h, bytes)| Op::Reserve { h, bytes }),
        3 => (0..16usize, 0..HOLDERS, 0..500u64).prop_map(|(g, as_h, actual)| Op::Commit { g, as_h, actual }),
        1 => (0..16usize, 0..HOLDERS).prop_map(|(g, as_h)| Op::Cancel { g, as_h }),
        3 => (0..16usize, 0..HOLDERS, 0..400u64).prop_map(|(l, as_h, bytes)| Op::Release { l, as_h, bytes }),
        1 => (0..1500u64).prop_map(|capacity| Op::SetCapacity { capacity }),
        1 => (0..HOLDERS).prop_map(|h| Op::Retire { h }),
        1 => (1..100u64).prop_map(|bytes| Op::Forged { bytes }),
    ]
}

/// The reference: the same rules written as plainly as possible.
#[derive(Debug, Default)]
struct Model {
    capacity: u64,
    grants: BTreeMap<usize, (usize, u64)>,
    leases: BTreeMap<usize, (usize, u64)>,
    retired: [bool; HOLDERS],
}

impl Model {
    fn approved(&self) -> u64 {
        self.grants
            .values()
            .chain(self.leases.values())
            .map(|(_, b)| b)
            .sum()
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Ok(u64),
    Err(&'static str),
}

fn kind(e: &LedgerError) -> &'static str {
    match e {
        LedgerError::Denied(_) => "denied",
        LedgerError::UnknownGrant(_) => "unknown grant",
        LedgerError::UnknownLease(_) => "unknown lease",
        LedgerError::NotYours { .. } => "not yours",
        LedgerError::ZeroBytes => "zero",
        LedgerError::ReleaseExceedsLease { .. } => "exceeds",
        LedgerError::HolderRetired(_) => "retired",
        LedgerError::UnknownHolder(_) => "unknown holder",
        _ => "other",
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, ..ProptestConfig::default() })]

    #[test]
    fn ledger_matches_the_reference_model(ops in prop::collection::vec(op(), 1..40)) {
        let mut l = Ledger::new();
        let a = l.add_authority("pool", 1000);
        let holders: Vec<HolderId> =
            (0..HOLDERS).map(|i| l.register_holder(a, format!("h{i}"), i as u32).unwrap()).collect();
        let (mut foreign_ledger, fa, fh, _) = setup(1000);
        let mut m = Model { capacity: 1000, ..Model::default() };
        // Every id ever issued stays here, so consumed ones get replayed.
        let mut grant_ids: Vec<GrantId> = Vec::new();
        let mut lease_ids: Vec<LeaseId> = Vec::new();

        for op in &ops {
            let approved_before = l.snapshot(a).unwrap().approved();
            let (got, want) = match *op {
                Op::Reserve { h, bytes } => {
                    let want = if m.retired[h] { Outcome::Err("retired") }
                        else if bytes == 0 { Outcome::Err("zero") }
                        else if m.approved() + bytes > m.capacity { Outcome::Err("denied") }
                        else { Outcome::Ok(bytes) };
                    let got = match l.reserve(holders[h], a, MemoryRole::KvCache, bytes) {
                        Ok(g) => {
                            m.grants.insert(grant_ids.len(), (h, bytes));
                            grant_ids.push(g.id);
                            Outcome::Ok(g.claim.bytes)
                        }
                        // A retired holder with nothing left is forgotten entirely.
                        Err(LedgerError::UnknownHolder(_)) if m.retired[h] => Outcome::Err("retired"),
                        Err(e) => Outcome::Err(kind(&e)),
                    };
                    (got, want)
                }
                Op::Commit { g, as_h, actual } => {
                    let Some(&id) = grant_ids.get(g) else { continue };
                    let want = match m.grants.get(&g) {
                        None => Outcome::Err("unknown grant"),
                        Some((owner, _)) if *owner != as_h => Outcome::Err("not yours"),
                        Some(_) if actual == 0 => Outcome::Err("zero"),
                        Some((_, bytes)) if actual > *bytes && m.approved() + (actual - bytes) > m.capacity => Outcome::Err("denied"),
                        Some(_) => Outcome::Ok(actual),
                    };
                    let got = match l.commit(holders[as_h], id, actual) {
                        Ok(lease) => {
                            let (owner, _) = m.grants.remove(&g).unwrap();
                            m.leases.insert(lease_ids.len(), (owner, actual));
                            lease_ids.push(lease.id);
                            Outcome::Ok(lease.claim.bytes)
                        }
                        Err(e) => Outcome::Err(kind(&e)),
                    };
                    (got, want)
                }
                Op::Cancel { g, as_h } => {
                    let Some(&id) = grant_ids.get(g) else { continue };
                    let want = match m.grants.get(&g) {
                        None => Outcome::Err("unknown grant"),
                        Some((owner, _)) if *owner != as_h => Outcome::Err("not yours"),
                        Some((_, bytes)) => Outcome::Ok(*bytes),
                    };
                    let got = match l.cancel(holders[as_h], id) {
                        Ok(b) => { m.grants.remove(&g); Outcome::Ok(b) }
                        Err(e) => Outcome::Err(kind(&e)),
                    };
                    (got, want)
                }
                Op::Release { l: li, as_h, bytes } => {
                    let Some(&id) = lease_ids.get(li) else { continue };
                    let want = match m.leases.get(&li) {
                        None => Outcome::Err("unknown lease"),
                        Some((owner, _)) if *owner != as_h => Outcome::Err("not yours"),
                        Some(_) if bytes == 0 => Outcome::Err("zero"),
                        Some((_, held)) if bytes > *held => Outcome::Err("exceeds"),
                        Some((_, held)) => Outcome::Ok(held - bytes),
                    };
                    let got = match l.release(holders[as_h], id, bytes) {
                        Ok(left) => {
                            if left == 0 { m.leases.remove(&li); } else { m.leases.get_mut(&li).unwrap().1 = left; }
                            Outcome::Ok(left)
                        }
                        Err(e) => Outcome::Err(kind(&e)),
                    };
                    (got, want)
                }
                Op::SetCapacity { capacity } => {
                    l.set_capacity(a, capacity).unwrap();
                    m.capacity = capacity;
                    (Outcome::Ok(0), Outcome::Ok(0))
                }
                Op::Retire { h } => {
                    let want = if m.retired[h] { Outcome::Err("retired") } else {
                        Outcome::Ok(m.grants.values().filter(|(o, _)| *o == h).map(|(_, b)| b).sum())
                    };
                    let got = match l.retire_holder(holders[h]) {
                        Ok(r) => {
                            m.grants.retain(|_, (o, _)| *o != h);
                            m.retired[h] = true;
                            Outcome::Ok(r.grants_returned.iter().map(|(_, b)| b).sum())
                        }
                        // A retired holder with nothing left is forgotten entirely.
                        Err(LedgerError::UnknownHolder(_)) if m.retired[h] => Outcome::Err("retired"),
                        Err(e) => Outcome::Err(kind(&e)),
                    };
                    (got, want)
                }
                Op::Forged { bytes } => {
                    let g = foreign_ledger.reserve(fh, fa, MemoryRole::KvCache, bytes).unwrap();
                    let before = l.snapshot(a).unwrap();
                    let got = match (l.commit(holders[0], g.id, bytes), l.cancel(holders[0], g.id)) {
                        (Err(LedgerError::UnknownGrant(_)), Err(LedgerError::UnknownGrant(_))) => Outcome::Err("unknown grant"),
                        other => panic!("a forged grant was accepted: {other:?}"),
                    };
                    prop_assert_eq!(l.snapshot(a).unwrap(), before);
                    (got, Outcome::Err("unknown grant"))
                }
            };
            prop_assert_eq!(&got, &want, "op {:?}", op);
            if let Err(e) = l.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
            let s = l.snapshot(a).unwrap();
            let model_provisional: u64 = m.grants.values().map(|(_, b)| b).sum();
            let model_leased: u64 = m.leases.values().map(|(_, b)| b).sum();
            prop_assert_eq!((s.provisional, s.leased), (model_provisional, model_leased), "op {:?}", op);
            prop_assert_eq!(s.approved(), s.provisional + s.leased);
            if s.approved() > approved_before {
                prop_assert!(s.approved() <= s.capacity, "approved grew past capacity on {:?}", op);
            }
        }
    }
}

/// A restarted Governor's books: rebuilt from what the holders report, with the same
/// identities, refusing reports that are not of these books or name something twice.
#[test]
fn books_rebuilt_from_holder_reports_equal_the_old_books() {
    let mut old = Ledger::new();
    let a = old.add_authority("gpu", 1000);
    let h1 = old.register_holder(a, "kv", 0).unwrap();
    let h2 = old.register_holder(a, "weights", 5).unwrap();
    let g1 = old.reserve(h1, a, MemoryRole::KvCache, 100).unwrap();
    let g2 = old.reserve(h2, a, MemoryRole::Weights, 300).unwrap();
    let l2 = old.commit(h2, g2.id, 250).unwrap();
    let reports = [
        HolderReport {
            holder: h1,
            name: "kv".into(),
            priority: 0,
            retired: false,
            grants: vec![(g1.id, MemoryRole::KvCache, 100)],
            leases: vec![],
            credit_lines: vec![],
        },
        HolderReport {
            holder: h2,
            name: "weights".into(),
            priority: 5,
            retired: false,
            grants: vec![],
            leases: vec![(l2.id, MemoryRole::Weights, 250)],
            credit_lines: vec![],
        },
    ];
    let mut new = old.successor(old.issued());
    assert_eq!(
        new.totals(a),
        Some(Totals {
            capacity: 1000,
            provisional: 0,
            leased: 0
        })
    );
    for r in &reports {
        new.recover_holder(a, r).unwrap();
    }
    new.check_invariants().unwrap();
    assert_eq!(new.totals(a), old.totals(a));
    assert_eq!(
        new.recover_holder(a, &reports[0]),
        Err(LedgerError::UnknownHolder(h1)),
        "twice"
    );
    // Old handles keep working against the new books, and new identities never collide.
    new.release(h2, l2.id, 50).unwrap();
    new.commit(h1, g1.id, 100).unwrap();
    let fresh = new.register_holder(a, "late", 0).unwrap();
    assert!(fresh.get() > g1.id.get() && fresh.get() > l2.id.get());
    // A report from other books is refused.
    let mut other = Ledger::new();
    let oa = other.add_authority("x", 10);
    let stranger = other.register_holder(oa, "s", 0).unwrap();
    let foreign = HolderReport {
        holder: stranger,
        ..reports[0].clone()
    };
    let mut again = old.successor(old.issued());
    assert!(again.recover_holder(a, &foreign).is_err());
}

/// Defect (issue 11, 2): a denial for another ledger's authority indexed a map and panicked.
#[test]
fn a_denial_for_another_ledgers_authority_says_so_without_panicking() {
    let mut mine = Ledger::new();
    mine.add_authority("mine", 10);
    let mut theirs = Ledger::new();
    let foreign = theirs.add_authority("theirs", 10);
    let d = mine.denial(foreign, u64::MAX);
    assert_eq!((d.capacity, d.approved, d.free()), (0, 0, 0));
    assert!(d.to_string().contains("unknown authority"), "{d}");
}

#[test]
fn books_split_off_a_topology_keep_the_authority_and_issue_their_own_ids() {
    let mut topology = Ledger::new();
    let host = topology.add_authority("host", 100);
    let gpu = topology.add_authority("cuda:0", 50);
    topology
        .bind_tier(Place::HOST, MemoryTier::Host, host)
        .unwrap();
    topology
        .bind_tier(Place::cuda(0), MemoryTier::Device, gpu)
        .unwrap();
    let mut host_books = topology.books_for(host).unwrap();
    let mut gpu_books = topology.books_for(gpu).unwrap();
    assert_eq!(
        host_books.authority_for(Place::HOST, MemoryTier::Host),
        Some(host)
    );
    assert_eq!(
        host_books.authority_for(Place::cuda(0), MemoryTier::Device),
        None,
        "only its own tiers"
    );
    assert_eq!(
        host_books.totals(host),
        Some(Totals {
            capacity: 100,
            provisional: 0,
            leased: 0
        })
    );
    assert_eq!(host_books.totals(gpu), None, "only its own authority");
    // Identifiers of one authority's books are unknown to the other's.
    let h = host_books.register_holder(host, "kv", 0).unwrap();
    let g = gpu_books.register_holder(gpu, "weights", 0).unwrap();
    let grant = host_books
        .reserve(h, host, MemoryRole::KvCache, 10)
        .unwrap();
    assert!(gpu_books.cancel(g, grant.id).is_err());
    assert!(matches!(
        topology.books_for(Ledger::new().add_authority("elsewhere", 1)),
        Err(LedgerError::UnknownAuthority(_))
    ));
    host_books.check_invariants().unwrap();
    gpu_books.check_invariants().unwrap();
}

#[test]
fn a_credit_line_is_a_lease_that_stays_open_at_zero_until_closed() {
    let mut l = Ledger::new();
    let a = l.add_authority("gpu", 1000);
    let h = l.register_holder(a, "kv", 0).unwrap();
    let line = l.open_credit(h, MemoryRole::KvCache).unwrap();
    assert_eq!(line.claim.bytes, 0);
    l.check_invariants().unwrap();
    let g = l.reserve(h, a, MemoryRole::KvCache, 600).unwrap();
    assert_eq!(l.commit_into(h, g.id, line.id).unwrap(), 600);
    let s = l.snapshot(a).unwrap();
    assert_eq!((s.provisional, s.leased, s.credit), (0, 600, 600));
    // Capacity bounds credit as any approval: 400 more fit, 401 do not.
    assert!(l.reserve(h, a, MemoryRole::KvCache, 401).is_err());
    // Released to zero (all taken back), the line stays open and can be topped up again.
    assert_eq!(l.release(h, line.id, 600).unwrap(), 0);
    assert!(l.is_credit(line.id) && l.lease(line.id).is_some());
    l.check_invariants().unwrap();
    let g2 = l.reserve(h, a, MemoryRole::KvCache, 100).unwrap();
    assert_eq!(l.commit_into(h, g2.id, line.id).unwrap(), 100);
    // Closed with bytes still used: an ordinary lease, gone at its last release.
    assert_eq!(l.close_credit(h, line.id).unwrap(), 100);
    assert!(!l.is_credit(line.id));
    assert_eq!(l.release(h, line.id, 100).unwrap(), 0);
    assert!(l.lease(line.id).is_none());
    l.check_invariants().unwrap();
    assert_eq!(
        l.totals(a),
        Some(Totals {
            capacity: 1000,
            provisional: 0,
            leased: 0
        })
    );
}

#[test]
fn credit_operations_refuse_foreign_and_wrong_handles_changing_nothing() {
    let mut l = Ledger::new();
    let a = l.add_authority("gpu", 1000);
    let h = l.register_holder(a, "kv", 0).unwrap();
    let other = l.register_holder(a, "other", 0).unwrap();
    let line = l.open_credit(h, MemoryRole::KvCache).unwrap();
    let g = l.reserve(h, a, MemoryRole::KvCache, 10).unwrap();
    let before = l.snapshot(a).unwrap();
    assert!(
        l.commit_into(other, g.id, line.id).is_err(),
        "another holder's grant"
    );
    let theirs = l.reserve(other, a, MemoryRole::KvCache, 10).unwrap();
    assert!(
        l.commit_into(h, theirs.id, line.id).is_err(),
        "grant of another holder"
    );
    let ordinary = l.commit(h, g.id, 10).unwrap();
    let g3 = l.reserve(h, a, MemoryRole::KvCache, 5).unwrap();
    assert_eq!(
        l.commit_into(h, g3.id, ordinary.id),
        Err(LedgerError::NotCredit(ordinary.id)),
        "an ordinary lease is no credit line"
    );
    assert!(
        l.close_credit(other, line.id).is_err(),
        "closed by another holder"
    );
    assert!(l.close_credit(h, ordinary.id).is_err());
    assert_eq!(l.snapshot(a).unwrap().credit, before.credit);
    l.check_invariants().unwrap();
    // A retired holder keeps its open line until it is closed.
    l.cancel(h, g3.id).unwrap();
    l.release(h, ordinary.id, 10).unwrap();
    l.retire_holder(h).unwrap();
    assert!(l.holder(h).is_some(), "kept while its line is open");
    assert!(
        l.open_credit(h, MemoryRole::KvCache).is_err(),
        "retired holders open none"
    );
    l.close_credit(h, line.id).unwrap();
    assert!(l.holder(h).is_none(), "gone with its last line");
    l.check_invariants().unwrap();
}

#[test]
fn a_report_with_credit_lines_rebuilds_them_zero_byte_lines_included() {
    let mut old = Ledger::new();
    let a = old.add_authority("gpu", 1000);
    let h = old.register_holder(a, "kv", 0).unwrap();
    let empty = old.open_credit(h, MemoryRole::KvCache).unwrap();
    let full = old.open_credit(h, MemoryRole::KvCache).unwrap();
    let g = old.reserve(h, a, MemoryRole::KvCache, 300).unwrap();
    old.commit_into(h, g.id, full.id).unwrap();
    let report = HolderReport {
        holder: h,
        name: "kv".into(),
        priority: 0,
        retired: false,
        grants: vec![],
        leases: vec![
            (empty.id, MemoryRole::KvCache, 0),
            (full.id, MemoryRole::KvCache, 300),
        ],
        credit_lines: vec![empty.id, full.id],
    };
    let mut new = old.successor(old.issued());
    new.recover_holder(a, &report).unwrap();
    new.check_invariants().unwrap();
    assert!(new.is_credit(empty.id) && new.is_credit(full.id));
    assert_eq!(new.snapshot(a).unwrap().credit, 300);
    // A zero-byte lease that is not a credit line, or a line that is not a lease, is refused.
    let mut bad = report.clone();
    bad.credit_lines = vec![full.id];
    assert!(old.successor(old.issued()).recover_holder(a, &bad).is_err());
    let mut bad = report;
    bad.leases.remove(0);
    assert!(old.successor(old.issued()).recover_holder(a, &bad).is_err());
}
