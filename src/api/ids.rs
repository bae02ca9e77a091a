//! Identities: places, tiers, roles, mechanisms, contexts and charges.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// What kind of place a memory pool lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlaceKind {
    /// Host RAM, reached through the CPU's page tables.
    Host,
    /// A CUDA device, reached through the CUDA driver.
    Cuda,
}

/// One place memory lives: its kind and its ordinal among places of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Place {
    /// The kind of place.
    pub kind: PlaceKind,
    /// Its index among places of the same kind (0 for the host).
    pub ordinal: u32,
}

impl Place {
    /// The host (there is one).
    pub const HOST: Place = Place {
        kind: PlaceKind::Host,
        ordinal: 0,
    };

    /// The CUDA device with this ordinal.
    pub const fn cuda(ordinal: u32) -> Self {
        Place {
            kind: PlaceKind::Cuda,
            ordinal,
        }
    }
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            PlaceKind::Host => write!(f, "host"),
            PlaceKind::Cuda => write!(f, "cuda:{}", self.ordinal),
        }
    }
}

/// Where bytes sit relative to the compute that uses them.
///
/// Tiers that alias the same physical bytes (unified memory) must share one authority;
/// the tier says where the bytes are seen from, not which pool pays for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryTier {
    /// Memory local to an accelerator.
    Device,
    /// Host memory (pageable or pinned).
    Host,
}

/// What the bytes are for. Holders use it to describe their charges; the Governor reports by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryRole {
    /// Model weights.
    Weights,
    /// Attention key/value cache.
    KvCache,
    /// Scratch space for kernels.
    Workspace,
    /// Activations between layers.
    Activations,
    /// Anything else.
    Other,
}

macro_rules! opaque_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u64);

        impl $name {
            /// A process-unique fresh identity.
            pub fn fresh() -> Self {
                static NEXT: AtomicU64 = AtomicU64::new(1);
                $name(NEXT.fetch_add(1, Ordering::Relaxed))
            }

            /// The raw number, for logs and metrics labels.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "#{}"), self.0)
            }
        }
    };
}

opaque_id!(
    /// Identity of one mechanism instance; every handle it creates carries it.
    MechanismId,
    "mechanism"
);
opaque_id!(
    /// Identity of one provider context (a CUDA context, the host process).
    ContextId,
    "context"
);
opaque_id!(
    /// Identity of the charge (grant or lease) that pays for an allocation.
    ChargeId,
    "charge"
);
opaque_id!(
    /// Identity of one physical block that may be mapped at several addresses.
    BlockId,
    "block"
);
