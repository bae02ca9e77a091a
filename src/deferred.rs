//! Deferred-free decisions, pure: when may an allocation used on several streams be freed,
//! and which fence it still waits for.

use crate::fence::{Fence, StreamId};

/// Where an allocation waiting to be freed should go next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Every fence that used it has completed: free it now.
    FreeNow,
    /// This fence is still pending: wait on its stream.
    WaitOn(Fence),
}

/// Decides the route for an allocation last used at `fences`, given each stream's completed
/// value (`Fenced` reads it from the timeline stored with each fence, never from a registry).
/// The first pending fence is returned; once it completes the allocation is routed again, so
/// it is freed only after *every* fence has completed.
pub fn route(
    fences: impl IntoIterator<Item = Fence>,
    completed: impl Fn(StreamId) -> u64,
) -> Route {
    fences
        .into_iter()
        .find(|f| completed(f.stream) < f.value)
        .map_or(Route::FreeNow, Route::WaitOn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_only_after_every_stream_completes() {
        let (a, b) = (StreamId::fresh(), StreamId::fresh());
        let fences = [
            Fence {
                stream: a,
                value: 3,
            },
            Fence {
                stream: b,
                value: 7,
            },
        ];
        let done = |ca: u64, cb: u64| move |s: StreamId| if s == a { ca } else { cb };
        assert_eq!(route(fences, done(2, 7)), Route::WaitOn(fences[0]));
        assert_eq!(route(fences, done(3, 6)), Route::WaitOn(fences[1]));
        assert_eq!(route(fences, done(3, 7)), Route::FreeNow);
        assert_eq!(route([], done(0, 0)), Route::FreeNow);
    }
}
