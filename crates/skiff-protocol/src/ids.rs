//! Prefixed, opaque ids. They are minted only by the gateway; other processes treat them as
//! strings they were handed.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// Wraps a string that already carries this id's prefix.
            pub fn parse(s: &str) -> Option<Self> {
                let rest = s.strip_prefix(Self::PREFIX)?;
                let well_formed = !rest.is_empty()
                    && rest.chars().all(|c| c.is_ascii_alphanumeric());
                well_formed.then(|| Self(s.to_owned()))
            }

            /// Builds an id from the random suffix minted by the gateway.
            pub fn from_suffix(suffix: &str) -> Self {
                Self(format!("{}{}", Self::PREFIX, suffix))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

id_type!(
    /// A session: one conversation with its own workspace.
    SessionId,
    "ses_"
);
id_type!(
    /// A run: one user turn and everything it causes.
    RunId,
    "run_"
);
id_type!(
    /// One execution of a run on one runtime node.
    AttemptId,
    "att_"
);
id_type!(
    /// An environment: one leased box.
    EnvironmentId,
    "env_"
);
id_type!(
    /// A transcript entry.
    EntryId,
    "ent_"
);
id_type!(
    /// A fan-out group: sibling sessions started together with the same prompt and base,
    /// one of which may be picked as the group's result.
    GroupId,
    "grp_"
);
id_type!(
    /// An approval: a tool call waiting for a person's decision.
    ApprovalId,
    "apr_"
);
id_type!(
    /// A one-time invocation grant for a governed action (`git_push`, `open_pull_request`).
    GrantId,
    "grt_"
);
id_type!(
    /// An artifact: a content-addressed blob with metadata (checkpoint, manifest, result, log).
    ArtifactId,
    "art_"
);
id_type!(
    /// A gateway process sharing the database with others: the holder of session and
    /// singleton leases (issue 17).
    GatewayId,
    "gw_"
);

/// A snapshot of a prepared box: `snap_` and 16 lowercase hex characters. Stricter than the
/// other ids because providers use it as a directory name and a lease CLI's argument.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SnapshotId(String);

impl SnapshotId {
    pub const PREFIX: &'static str = "snap_";

    pub fn parse(s: &str) -> Option<Self> {
        let hex = s.strip_prefix(Self::PREFIX)?;
        let well_formed = hex.len() == 16
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| Self(s.to_owned()))
    }

    /// The id for 8 random bytes (the gateway draws them; this crate does no I/O).
    pub fn from_random(bytes: [u8; 8]) -> Self {
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(format!("{}{hex}", Self::PREFIX))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for SnapshotId {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        Self::parse(&s).ok_or_else(|| {
            format!("{s:?} is not a snapshot id (`snap_` and 16 lowercase hex characters)")
        })
    }
}

impl From<SnapshotId> for String {
    fn from(id: SnapshotId) -> String {
        id.0
    }
}

impl fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_are_snap_and_sixteen_hex() {
        let id = SnapshotId::from_random([0, 1, 2, 3, 0xfc, 0xfd, 0xfe, 0xff]);
        assert_eq!(id.as_str(), "snap_00010203fcfdfeff");
        assert_eq!(SnapshotId::parse(id.as_str()), Some(id.clone()));
        for bad in [
            "snap_00010203FCFDFEFF",
            "snap_0001",
            "snap_../../etc/pa",
            "env_00010203fcfdfeff",
        ] {
            assert!(SnapshotId::parse(bad).is_none(), "{bad}");
        }
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"snap_00010203fcfdfeff\"");
        assert!(serde_json::from_str::<SnapshotId>("\"snap_x\"").is_err());
    }

    #[test]
    fn parse_requires_prefix_and_suffix() {
        assert!(SessionId::parse("ses_abc123").is_some());
        assert!(SessionId::parse("ses_").is_none());
        assert!(SessionId::parse("run_abc").is_none());
        assert!(SessionId::parse("ses_../x").is_none());
    }
}
