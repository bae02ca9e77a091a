//! After every step of long random sequences of grow/shrink/commit/decommit on several
//! buffers, the bytes our bookkeeping believes committed equal what the kernel reports.
#![cfg(target_os = "linux")]

use procmem::host::HostMechanism;
use procmem::{
    MemoryError, MemoryMechanism, MemoryRole, VirtualAllocation, VirtualBuffer, VirtualRequest,
};
use proptest::prelude::*;

const BUFFERS: usize = 3;
const RAWS: usize = 2;
const GRANULES: u64 = 24;

#[derive(Debug, Clone)]
enum Op {
    Grow {
        buf: usize,
        granules: u64,
    },
    Shrink {
        buf: usize,
        granules: u64,
    },
    Commit {
        raw: usize,
        start: u64,
        granules: u64,
    },
    Decommit {
        raw: usize,
        start: u64,
        granules: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..BUFFERS, 0..6u64).prop_map(|(buf, granules)| Op::Grow { buf, granules }),
        (0..BUFFERS, 0..6u64).prop_map(|(buf, granules)| Op::Shrink { buf, granules }),
        (0..RAWS, 0..GRANULES + 2, 0..6u64).prop_map(|(raw, start, granules)| Op::Commit {
            raw,
            start,
            granules
        }),
        (0..RAWS, 0..GRANULES + 2, 0..6u64).prop_map(|(raw, start, granules)| Op::Decommit {
            raw,
            start,
            granules
        }),
    ]
}

struct World {
    host: HostMechanism,
    buffers: Vec<VirtualBuffer>,
    raws: Vec<VirtualAllocation>,
}

impl World {
    fn new() -> Self {
        let host = HostMechanism::new().unwrap();
        let g = procmem::granularity();
        let buffers = (0..BUFFERS)
            .map(|_| VirtualBuffer::new(host.backing(), GRANULES * g, MemoryRole::KvCache).unwrap())
            .collect();
        let backing = host.virtual_backing().unwrap();
        let raws = (0..RAWS)
            .map(|_| {
                backing
                    .reserve(&VirtualRequest {
                        bytes: GRANULES * g,
                        role: MemoryRole::Workspace,
                    })
                    .unwrap()
            })
            .collect();
        World {
            host,
            buffers,
            raws,
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), MemoryError> {
        let g = procmem::granularity();
        let backing = self.host.virtual_backing().unwrap();
        match *op {
            Op::Grow { buf, granules } => self.buffers[buf].grow(granules * g).map(drop),
            Op::Shrink { buf, granules } => self.buffers[buf].shrink(granules * g).map(drop),
            Op::Commit {
                raw,
                start,
                granules,
            } => backing
                .commit_range(&mut self.raws[raw], start * g..(start + granules) * g)
                .map(drop),
            Op::Decommit {
                raw,
                start,
                granules,
            } => backing
                .decommit_range(&mut self.raws[raw], start * g..(start + granules) * g)
                .map(drop),
        }
    }

    /// (what we believe per handle, what the kernel says per handle, kernel total)
    fn books(&self) -> (Vec<u64>, Vec<u64>, u64) {
        let backing = self.host.virtual_backing().unwrap();
        let mut believed = Vec::new();
        let mut reported = Vec::new();
        for b in &self.buffers {
            believed.push(b.allocation().granules().committed_bytes());
            reported.push(b.resident_bytes().unwrap());
            assert_eq!(b.len(), b.allocation().granules().committed_bytes());
        }
        for r in &self.raws {
            believed.push(r.granules().committed_bytes());
            reported.push(backing.committed_bytes(r).unwrap());
        }
        (
            believed,
            reported,
            self.host.backing().resident_bytes().unwrap(),
        )
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn believed_committed_bytes_equal_the_kernels(ops in prop::collection::vec(op(), 1..250)) {
        let mut world = World::new();
        for (step, op) in ops.iter().enumerate() {
            let before = world.books();
            let result = world.apply(op);
            let (believed, reported, total) = world.books();
            prop_assert_eq!(&believed, &reported, "step {} {:?} -> {:?}", step, op, result);
            prop_assert_eq!(believed.iter().sum::<u64>(), total, "step {} {:?}", step, op);
            if result.is_err() {
                prop_assert_eq!((believed, reported, total), before, "a refusal changed state at step {}", step);
            }
        }
    }
}
