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
    /// An artifact: a content-addressed blob with metadata (checkpoint, manifest, result, log).
    ArtifactId,
    "art_"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_requires_prefix_and_suffix() {
        assert!(SessionId::parse("ses_abc123").is_some());
        assert!(SessionId::parse("ses_").is_none());
        assert!(SessionId::parse("run_abc").is_none());
        assert!(SessionId::parse("ses_../x").is_none());
    }
}
