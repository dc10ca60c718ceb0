//! The run state machine. [`run`] is the only way a run's status changes; the store calls it
//! inside the transaction that persists the change.

use skiff_protocol::api::RunStatus;

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
        Queued => matches!(to, Starting | Cancelled | Failed),
        Starting => matches!(to, Running | Cancelling | Cancelled | Failed),
        Running => matches!(
            to,
            WaitingInput | WaitingApproval | Cancelling | Succeeded | Failed | TimedOut
        ),
        WaitingInput | WaitingApproval => matches!(to, Running | Cancelling | Failed | TimedOut),
        Cancelling => matches!(to, Cancelled | Failed),
        Succeeded | Failed | Cancelled | TimedOut | Orphaned => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RunStatus::*;

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
