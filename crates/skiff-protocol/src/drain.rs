//! `skiff gateway drain` (issue 17): what the CLI asks a gateway and what it streams back
//! while the gateway hands its sessions to the others and exits.

use crate::GatewayId;
use serde::{Deserialize, Serialize};

/// `POST /v1/gateway/drain`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// Drain even with no other live gateway: running turns are then stopped and orphaned as
    /// at a restart, and no one goes on with them.
    #[serde(default)]
    pub force: bool,
}

/// One line of the drain's answer (`application/x-ndjson`): progress lines, then the report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DrainLine {
    /// The gateway is handing `turns` running turns over; `left` of them still winding down
    /// here.
    Progress { turns: u64, left: u64 },
    /// The gateway is done and exits.
    Drained(DrainReport),
}

/// What a finished drain did (`skiff gateway drain --json` prints this).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainReport {
    pub gateway: GatewayId,
    /// Sessions whose lease was released for another gateway to take over (the running
    /// turns among them go on there as new attempts).
    pub handed_over: u64,
    /// Running turns stopped here for the hand-over.
    pub turns: u64,
    /// Whether other gateways were live to take over; `false` only with `force`.
    pub others: bool,
    pub seconds: f64,
}
