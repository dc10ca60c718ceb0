//! The state machines' legal moves: runs ([`run_allowed`]), environments, snapshots and
//! placements. The store checks every change against them inside the transaction that persists
//! it; nothing else moves a state.

use skiff_protocol::api::RunStatus;
use skiff_protocol::environment::{EnvironmentState, PlacementState, SnapshotState};

/// Whether a run may move from `from` to `to`.
pub fn run_allowed(from: RunStatus, to: RunStatus) -> bool {
    use RunStatus::*;
    if from.is_terminal() {
        return false;
    }
    // Evidence that the runtime died can arrive in any live state.
    if to == Orphaned {
        return true;
    }
    match from {
        Queued => matches!(to, Starting | Cancelling | Cancelled | Failed | TimedOut),
        // A turn whose box takes longer than its time limit to be placed times out here.
        Starting => matches!(to, Running | Cancelling | Cancelled | Failed | TimedOut),
        Running => matches!(
            to,
            WaitingInput | WaitingApproval | Cancelling | Succeeded | Failed | TimedOut
        ),
        WaitingInput | WaitingApproval => matches!(to, Running | Cancelling | Failed | TimedOut),
        Cancelling => matches!(to, Cancelled | Failed),
        Succeeded | Failed | Cancelled | TimedOut | Orphaned => false,
    }
}

/// Whether an environment may move from `from` to `to`. `destroying → destroying` records a
/// retry that still lacks evidence.
pub fn environment_allowed(from: EnvironmentState, to: EnvironmentState) -> bool {
    use EnvironmentState::*;
    match from {
        Destroyed => false,
        Requested => matches!(to, Provisioning | Failed | Destroying | Orphaned),
        Provisioning => matches!(to, Bootstrapping | Failed | Destroying | Orphaned),
        Bootstrapping => matches!(to, Ready | Failed | Destroying | Orphaned),
        Ready => matches!(
            to,
            Attached | Idle | Draining | Failed | Destroying | Orphaned
        ),
        Attached => matches!(to, Idle | Draining | Failed | Orphaned),
        Idle => matches!(to, Attached | Draining | Failed | Destroying | Orphaned),
        Draining => matches!(to, Destroying | Failed | Orphaned),
        Destroying => matches!(to, Destroying | Destroyed | Failed),
        Failed | Orphaned => matches!(to, Destroying),
    }
}

/// Whether a snapshot may move from `from` to `to`. A `deleting` row goes away once the
/// provider has deleted the snapshot; it never becomes ready again (`deleting → deleting`
/// records a retry).
pub fn snapshot_allowed(from: SnapshotState, to: SnapshotState) -> bool {
    use SnapshotState::*;
    match from {
        Capturing => matches!(to, Ready | Deleting),
        Ready | Deleting => matches!(to, Deleting),
    }
}

/// Whether a session's placement may move from `from` to `to`. v1 dispatches local → worker
/// only; a worker session goes `reconciling` after each turn and back to `active`; a dead box
/// makes it `reclaimed`, and the next message places it again. Between turns an `active`
/// session gives its box back (`parked`: its last turn is already reconciled and
/// checkpointed, so nothing is on the box that the gateway lacks); the next message places it
/// again, and bringing it home needs no drain (`parked → local`, as from `reclaimed` and
/// `failed`, which hold no box either). Pulling back an `active` session is the migration
/// barrier: `draining` (admission stopped, the worker stopped; `draining → draining` records
/// the owner epoch advanced past it), `reconciling` only when the box holds work the gateway
/// lacks, then `local`. A pull-back that cannot finish leaves the session on its box
/// (`draining|reconciling → active`).
///
/// A live move (`--live`) goes through `handing_off` while its turn runs on. Home to box:
/// `local → handing_off` (the gateway's loop finishes its step), `→ requested` and the usual
/// placement to `active`, where the same run goes on; a gateway restart in between brings it
/// back (`handing_off → local`). Box to home: `active → handing_off` (the worker's step
/// finishes; its next model call is held), `handing_off → handing_off` records the epoch
/// advanced past the stopped worker, `→ reconciling` when the box holds work the gateway
/// lacks, then `local`, where the run goes on. A turn that ends before its next model call
/// reconciles as usual and goes back to waiting (`handing_off → reconciling → handing_off`),
/// then comes home at the boundary.
/// One that cannot finish stays on its box (`handing_off → active`) or fails.
///
/// Automatic failover: a box that died under a running turn is `reclaimed` (with its
/// evidence), then `failed_over` while the run's new attempt is placed on a fresh box
/// (`failed_over → requested` keeps the slot it holds); a failover that cannot be placed
/// fails, and one whose turn ended meanwhile may come home.
pub fn placement_allowed(from: PlacementState, to: PlacementState) -> bool {
    use PlacementState::*;
    match from {
        Local => matches!(to, Requested | HandingOff),
        Reclaimed => matches!(to, Requested | Local | FailedOver),
        Parked | Failed => matches!(to, Requested | Local),
        FailedOver => matches!(to, Requested | Local | Failed),
        Requested => matches!(to, Provisioning | Failed),
        Provisioning => matches!(to, Syncing | Failed | Reclaimed),
        Syncing => matches!(to, Setup | Starting | Failed | Reclaimed),
        Setup => matches!(to, Starting | Failed | Reclaimed),
        // `starting → starting`: a replacement worker on the same box (new epoch).
        Starting => matches!(to, Starting | Active | Failed | Reclaimed),
        Active => matches!(
            to,
            Starting | Reconciling | Draining | HandingOff | Parked | Failed | Reclaimed
        ),
        HandingOff => matches!(
            to,
            HandingOff | Requested | Reconciling | Active | Local | Failed | Reclaimed
        ),
        Reconciling => matches!(to, Active | HandingOff | Local | Failed | Reclaimed),
        Draining => matches!(
            to,
            Draining | Reconciling | Active | Local | Failed | Reclaimed
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RunStatus::*;

    #[test]
    fn placements_follow_the_design() {
        use PlacementState as P;
        let path = [
            P::Local,
            P::Requested,
            P::Provisioning,
            P::Syncing,
            P::Starting,
            P::Active,
            P::Reconciling,
            P::Active,
            P::Reclaimed,
            P::Requested,
        ];
        for pair in path.windows(2) {
            assert!(
                placement_allowed(pair[0], pair[1]),
                "{} -> {}",
                pair[0],
                pair[1]
            );
        }
        assert!(!placement_allowed(P::Local, P::Active));
        assert!(!placement_allowed(P::Reclaimed, P::Active));
        assert!(!placement_allowed(P::Provisioning, P::Active));
    }

    #[test]
    fn only_a_session_between_turns_is_parked_and_its_next_message_places_it_again() {
        use PlacementState as P;
        // A turn, its reconciliation, parked; the next message, placed again, parked again.
        let path = [
            P::Active,
            P::Reconciling,
            P::Active,
            P::Parked,
            P::Requested,
            P::Provisioning,
            P::Syncing,
            P::Starting,
            P::Active,
            P::Parked,
        ];
        for pair in path.windows(2) {
            assert!(
                placement_allowed(pair[0], pair[1]),
                "{} -> {}",
                pair[0],
                pair[1]
            );
        }
        // Mid-placement and mid-reconciliation a session holds work the gateway does not
        // have yet: it is never parked there.
        for from in P::ALL.into_iter().filter(|s| *s != P::Active) {
            assert!(!placement_allowed(from, P::Parked), "{from} -> parked");
        }
        // A parked session has no box: it neither runs nor reconciles nor loses a box.
        for to in [
            P::Active,
            P::Starting,
            P::Syncing,
            P::Reconciling,
            P::Draining,
            P::Reclaimed,
            P::Parked,
        ] {
            assert!(!placement_allowed(P::Parked, to), "parked -> {to}");
        }
        // Coming home from parked needs no drain: its work is already here.
        assert!(placement_allowed(P::Parked, P::Local));
    }

    #[test]
    fn a_pull_back_drains_fences_reconciles_when_needed_and_comes_home() {
        use PlacementState as P;
        for path in [
            &[P::Active, P::Draining, P::Draining, P::Local][..],
            &[
                P::Active,
                P::Draining,
                P::Draining,
                P::Reconciling,
                P::Local,
            ],
            // The box's work could not come back: the session stays on its box.
            &[
                P::Active,
                P::Draining,
                P::Draining,
                P::Reconciling,
                P::Active,
            ],
            &[P::Reclaimed, P::Local],
            &[P::Failed, P::Local],
        ] {
            for pair in path.windows(2) {
                assert!(
                    placement_allowed(pair[0], pair[1]),
                    "{} -> {}",
                    pair[0],
                    pair[1]
                );
            }
        }
        // Only a session on a box between turns drains; mid-placement it has no worker to stop.
        for from in [
            P::Local,
            P::Requested,
            P::Provisioning,
            P::Syncing,
            P::Starting,
            P::Parked,
        ] {
            assert!(!placement_allowed(from, P::Draining), "{from} -> draining");
        }
        // Nothing comes home mid-placement: the box may be half laid down.
        for from in [
            P::Requested,
            P::Provisioning,
            P::Syncing,
            P::Setup,
            P::Starting,
        ] {
            assert!(!placement_allowed(from, P::Local), "{from} -> local");
        }
    }

    #[test]
    fn a_live_move_hands_off_in_either_direction_and_nothing_else_does() {
        use PlacementState as P;
        for path in [
            // Home to box: the gateway's step finishes, then the usual placement.
            &[
                P::Local,
                P::HandingOff,
                P::Requested,
                P::Provisioning,
                P::Syncing,
                P::Starting,
                P::Active,
            ][..],
            // Box to home: drained, fenced, the box's work brought back, home.
            &[
                P::Active,
                P::HandingOff,
                P::HandingOff,
                P::Reconciling,
                P::Local,
            ],
            &[P::Active, P::HandingOff, P::HandingOff, P::Local],
            // The turn ended before its next model call: reconciled as usual, then home.
            &[
                P::Active,
                P::HandingOff,
                P::Reconciling,
                P::HandingOff,
                P::HandingOff,
                P::Local,
            ],
        ] {
            for pair in path.windows(2) {
                assert!(
                    placement_allowed(pair[0], pair[1]),
                    "{} -> {}",
                    pair[0],
                    pair[1]
                );
            }
        }
        // Only a session that runs somewhere hands off (or goes back to waiting for its move
        // after reconciling): mid-placement, parked or without a box there is no owner to drain.
        for from in [
            P::Requested,
            P::Provisioning,
            P::Syncing,
            P::Setup,
            P::Starting,
            P::Draining,
            P::Parked,
            P::Reclaimed,
            P::Failed,
        ] {
            assert!(
                !placement_allowed(from, P::HandingOff),
                "{from} -> handing_off"
            );
        }
        // A handoff never skips the placement of the new owner.
        for to in [
            P::Provisioning,
            P::Syncing,
            P::Starting,
            P::Parked,
            P::Draining,
        ] {
            assert!(!placement_allowed(P::HandingOff, to), "handing_off -> {to}");
        }
    }

    #[test]
    fn a_box_that_died_mid_run_fails_over_to_a_fresh_one_and_nothing_else_does() {
        use PlacementState as P;
        for path in [
            // Died mid-run, failed over, placed again on a fresh box.
            &[
                P::Active,
                P::Reclaimed,
                P::FailedOver,
                P::Requested,
                P::Provisioning,
                P::Syncing,
                P::Starting,
                P::Active,
                P::Reclaimed,
                P::FailedOver,
                P::Requested,
            ][..],
            // The fresh box could not be had; a gateway restart mid-failover.
            &[P::Reclaimed, P::FailedOver, P::Failed],
            // The turn ended while failing over: brought home, nothing to drain.
            &[P::Reclaimed, P::FailedOver, P::Local],
        ] {
            for pair in path.windows(2) {
                assert!(
                    placement_allowed(pair[0], pair[1]),
                    "{} -> {}",
                    pair[0],
                    pair[1]
                );
            }
        }
        // Only a box lost with its evidence fails over: a live owner is never replaced by a
        // second one, and a settled session without a run has nothing to fail over.
        for from in P::ALL.into_iter().filter(|s| *s != P::Reclaimed) {
            assert!(
                !placement_allowed(from, P::FailedOver),
                "{from} -> failed_over"
            );
        }
        // A failover holds no box: it neither runs, reconciles, drains nor parks.
        for to in [
            P::Provisioning,
            P::Syncing,
            P::Starting,
            P::Active,
            P::Reconciling,
            P::Draining,
            P::HandingOff,
            P::Parked,
            P::Reclaimed,
            P::FailedOver,
        ] {
            assert!(!placement_allowed(P::FailedOver, to), "failed_over -> {to}");
        }
    }

    #[test]
    fn environments_follow_the_design() {
        use EnvironmentState as E;
        let path = [
            E::Requested,
            E::Provisioning,
            E::Bootstrapping,
            E::Ready,
            E::Idle,
            E::Attached,
            E::Idle,
            E::Draining,
            E::Destroying,
            E::Destroyed,
        ];
        for pair in path.windows(2) {
            assert!(
                environment_allowed(pair[0], pair[1]),
                "{} -> {}",
                pair[0],
                pair[1]
            );
        }
        for to in E::ALL {
            assert!(!environment_allowed(E::Destroyed, to));
        }
        assert!(
            !environment_allowed(E::Attached, E::Destroying),
            "an attached box is drained first"
        );
        assert!(!environment_allowed(E::Failed, E::Ready));
    }

    #[test]
    fn terminal_states_are_final() {
        for from in RunStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in RunStatus::ALL {
                assert!(!run_allowed(from, to), "{from} -> {to}");
            }
        }
    }

    #[test]
    fn happy_and_cancel_paths() {
        assert!(run_allowed(Queued, Starting));
        assert!(run_allowed(Starting, Running));
        assert!(run_allowed(Running, Succeeded));
        assert!(run_allowed(Running, Cancelling));
        assert!(run_allowed(Cancelling, Cancelled));
        assert!(!run_allowed(Queued, Succeeded));
        assert!(!run_allowed(Cancelling, Running));
    }

    #[test]
    fn any_live_state_can_be_orphaned() {
        for from in RunStatus::ALL.into_iter().filter(|s| !s.is_terminal()) {
            assert!(run_allowed(from, Orphaned), "{from}");
        }
    }
}
