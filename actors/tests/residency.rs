//! Model residency under pressure: cold, unpinned layers go to the host tier (or, without
//! one, to disk) through a copy on the stream, their device memory is freed after that copy's
//! fence, and they come back intact before use.

use std::time::Duration;

use procmem_actors::procmem::MemoryRole;
use procmem_actors::{
    governor::{GovernorConfig, GovernorHandle, ReserveRequest},
    provider::{CpuProvider, CpuProviderConfig},
    residency::{Placement, ResidencyArgs, ResidencyConfig, ResidencyHandle},
};

const LAYER: usize = 64 * 1024;

fn weights(layer: usize) -> Vec<u8> {
    (0..LAYER).map(|i| (i * 7 + layer * 31) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_layers_offload_under_pressure_and_reload_intact() {
    let (device, _) = GovernorHandle::spawn(GovernorConfig::new("device", 5 * LAYER as u64))
        .await
        .unwrap();
    let (host, _) = GovernorHandle::spawn(GovernorConfig::new("host-tier", 1 << 30))
        .await
        .unwrap();
    let provider = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let config = ResidencyConfig::new("weights")
        .priority(1)
        .wait(Duration::from_secs(1));
    let (res, _) = ResidencyHandle::spawn(ResidencyArgs {
        config,
        device: device.clone(),
        host: Some(host.clone()),
        provider: provider.into(),
    })
    .await
    .unwrap();
    for layer in 0..4 {
        res.load(layer, weights(layer), layer == 0).await.unwrap();
    }
    // Layer 3 is used last, so layers 1 and 2 are the coldest unpinned ones.
    for layer in [0, 1, 2, 3] {
        let sum = res
            .with_weights(layer, |w| w.iter().map(|b| *b as u64).sum::<u64>())
            .await
            .unwrap();
        assert_eq!(sum, weights(layer).iter().map(|b| *b as u64).sum::<u64>());
    }
    assert_eq!(
        device.snapshot().await.unwrap().books.leased,
        4 * LAYER as u64
    );

    let other = device.register_holder("kv", 0, None).await.unwrap();
    let grant = device
        .reserve(ReserveRequest {
            holder: other,
            role: MemoryRole::KvCache,
            bytes: 2 * LAYER as u64,
            priority: 5,
            deadline: Some(tokio::time::Instant::now() + Duration::from_secs(5)),
        })
        .await
        .expect("residency made room");
    let placements: Vec<_> = futures_placements(&res).await;
    assert_eq!(placements[0], Some(Placement::Device), "pinned layers stay");
    assert_eq!(
        placements[1],
        Some(Placement::Host),
        "the coldest layer went first"
    );
    assert_eq!(
        placements[3],
        Some(Placement::Device),
        "the most recent layer stayed"
    );
    let stats = res.stats().await.unwrap();
    assert!(stats.offloads >= 1);
    assert_eq!(
        host.snapshot().await.unwrap().books.leased,
        stats.offloaded_bytes,
        "host copies are charged to the host tier"
    );
    let books = device.snapshot().await.unwrap().books;
    assert_eq!(
        books.leased, stats.device_bytes,
        "device bytes were refunded after the copy fences"
    );

    // Room again: the offloaded layer reloads before use, byte for byte.
    drop(grant);
    let back = res.with_weights(1, |w| w.to_vec()).await.unwrap();
    assert!(back == weights(1), "layer 1 came back intact");
    assert_eq!(res.placement(1).await.unwrap(), Some(Placement::Device));
    assert!(res.stats().await.unwrap().reloads >= 1);
}

async fn futures_placements(res: &ResidencyHandle) -> Vec<Option<Placement>> {
    let mut out = Vec::new();
    for layer in 0..4 {
        out.push(res.placement(layer).await.unwrap());
    }
    out
}

/// A device Governor of `capacity` bytes, a CPU provider and a residency configuration.
async fn device_only(capacity: u64) -> (GovernorHandle, CpuProvider, ResidencyConfig) {
    let (device, _) = GovernorHandle::spawn(GovernorConfig::new("device", capacity))
        .await
        .unwrap();
    let provider = CpuProvider::spawn(CpuProviderConfig::default())
        .await
        .unwrap();
    let config = ResidencyConfig::new("weights")
        .priority(1)
        .wait(Duration::from_millis(100));
    (device, provider, config)
}

/// Defect (issue 13, 6): a load at a huge layer index sized the layer table from it and
/// overflowed (`usize::MAX`) or aborted the process on the allocation. It is a typed error,
/// nothing is charged, and residency goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_at_a_huge_layer_index_is_a_typed_error() {
    let (device, provider, config) = device_only(1 << 30).await;
    let (res, _) = ResidencyHandle::spawn(ResidencyArgs {
        config,
        device: device.clone(),
        host: None,
        provider: provider.into(),
    })
    .await
    .unwrap();
    for layer in [usize::MAX, usize::MAX / 2, 1 << 40, 1 << 16] {
        let refused = res.load(layer, weights(0), false).await;
        assert!(
            matches!(
                refused,
                Err(procmem_actors::residency::ResidencyError::LayerOutOfRange { .. })
            ),
            "layer {layer}: {refused:?}"
        );
    }
    assert_eq!(device.snapshot().await.unwrap().books.leased, 0);
    res.load(3, weights(3), false).await.unwrap();
    assert_eq!(res.stats().await.unwrap().resident_layers, 1);
}

/// A host tier that is the device's own authority is refused (a copy there frees nothing);
/// without a host tier (the host backend) offloaded layers go to an unlinked file on disk, as
/// swapped KV does, and come back byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_host_tier_offloads_go_to_disk() {
    let (device, provider, config) = device_only(1 << 20).await;
    let aliased = ResidencyHandle::spawn(ResidencyArgs {
        config: config.clone(),
        device: device.clone(),
        host: Some(device.clone()),
        provider: provider.clone().into(),
    })
    .await;
    assert!(
        matches!(
            aliased,
            Err(procmem_actors::residency::ResidencyError::HostAliased)
        ),
        "{aliased:?}"
    );
    let (res, _) = ResidencyHandle::spawn(ResidencyArgs {
        config,
        device: device.clone(),
        host: None,
        provider: provider.into(),
    })
    .await
    .unwrap();
    res.load(0, weights(0), false).await.unwrap();
    let held = device.snapshot().await.unwrap().books.leased;
    // Another holder wants all but half the layer: residency offloads it to disk.
    let other = device.register_holder("other", 9, None).await.unwrap();
    let grant = device
        .reserve(procmem_actors::governor::ReserveRequest {
            holder: other,
            role: procmem_actors::procmem::MemoryRole::Workspace,
            bytes: (1 << 20) - held / 2,
            priority: 9,
            deadline: Some(tokio::time::Instant::now() + Duration::from_secs(5)),
        })
        .await
        .expect("residency made room");
    assert_eq!(res.placement(0).await.unwrap(), Some(Placement::Disk));
    let s = res.stats().await.unwrap();
    assert_eq!(
        (s.resident_layers, s.offloaded_layers, s.offloads),
        (0, 1, 1)
    );
    assert_eq!(s.offloaded_bytes, LAYER as u64);
    assert_eq!(device.snapshot().await.unwrap().books.leased, 0, "refunded");
    drop(grant);
    let back = res.with_weights(0, |w| w.to_vec()).await.unwrap();
    assert!(back == weights(0), "layer 0 came back from disk intact");
    assert_eq!(res.placement(0).await.unwrap(), Some(Placement::Device));
}

/// A device that holds two of four layers: each use of an offloaded layer first offloads the
/// residency's own coldest layer (no ticket to itself, no wait for its deadline), then
/// reloads; every use reads that layer's own bytes and the kernel never holds more than the
/// capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_smaller_than_the_model_cycles_layers_through_disk() {
    let capacity = 2 * LAYER as u64 + LAYER as u64 / 2;
    let (device, provider, config) = device_only(capacity).await;
    let os = provider.clone();
    let (res, _) = ResidencyHandle::spawn(ResidencyArgs {
        config,
        device: device.clone(),
        host: None,
        provider: provider.into(),
    })
    .await
    .unwrap();
    for layer in 0..4 {
        res.load(layer, weights(layer), false).await.unwrap();
    }
    // (A reload that waited for a ticket to itself would miss its 100 ms deadline and fail.)
    for round in 0..3 {
        for layer in 0..4 {
            let sum = res
                .with_weights(layer, |w| w.iter().map(|b| *b as u64).sum::<u64>())
                .await
                .unwrap();
            assert_eq!(
                sum,
                weights(layer).iter().map(|b| *b as u64).sum::<u64>(),
                "round {round}, layer {layer}"
            );
            // What the kernel holds for the device never exceeds its capacity: memory is
            // taken only after its grant and freed before its refund.
            let resident = os.mechanism().host_allocator().resident_total().unwrap();
            assert!(resident <= capacity, "{resident} B resident of {capacity}");
        }
    }
    let s = res.stats().await.unwrap();
    assert!(s.reloads >= 12, "{s:?}");
    assert!(s.offloads >= 12, "{s:?}");
    assert_eq!(s.resident_layers + s.offloaded_layers, 4);
}
