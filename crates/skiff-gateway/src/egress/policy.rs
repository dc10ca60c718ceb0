//! The allowlist: rules as written in `skiff.toml` (`egress.setup = ["preset:python",
//! "git.example.com", "*.internal.example", "127.0.0.1:8080"]`), parsed once, matched per
//! request, and the one place that words a refusal.
//!
//! Two questions, asked in order: is the name (or IP literal) on the list, and may the
//! addresses it resolves to be reached. The second only bites for non-public addresses
//! ([`super::address`]), which need an *explicit* rule: an exact host or IP rule written in the
//! list, never a wildcard or a preset.

use super::address::{self, AddressClass};
use super::presets;
use super::target::{self, Host, Target};
use serde::{Deserialize, Serialize};
use std::net::IpAddr;

/// A rule list that did not parse. Names the config key and the rule, and lists the presets.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PolicyError {
    #[error("{key}: \"{rule}\" names an unknown preset; known presets are {known}")]
    UnknownPreset {
        key: String,
        rule: String,
        known: String,
    },
    #[error(
        "{key}: \"{rule}\" is not a host rule ({why}); write a host (\"git.example.com\"), a \
         wildcard (\"*.example.com\"), an IP address, each optionally with \":port\", or one of \
         {known}"
    )]
    Malformed {
        key: String,
        rule: String,
        why: &'static str,
        known: String,
    },
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Refusal {
    /// No rule allows the host and port.
    NotListed,
    /// The host is listed, but only by a wildcard or a preset, and it resolves to an address
    /// that is not public.
    NonPublic {
        address: IpAddr,
        class: AddressClass,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Pattern {
    Exact(Host),
    /// `*.suffix`, stored as `.suffix`: matches names ending in it, not the bare suffix.
    Subdomains(String),
}

#[derive(Clone, Debug)]
struct Rule {
    /// As written (`preset:python` for a preset's hosts), for audit.
    text: String,
    pattern: Pattern,
    /// `None`: any port.
    port: Option<u16>,
    /// Written in the list as an exact host or IP (not a wildcard, not from a preset): only
    /// such a rule lets a name reach a non-public address.
    explicit: bool,
}

impl Rule {
    fn matches(&self, target: &Target) -> bool {
        if self.port.is_some_and(|p| p != target.port) {
            return false;
        }
        match (&self.pattern, &target.host) {
            (Pattern::Exact(host), want) => host == want,
            (Pattern::Subdomains(suffix), Host::Name(name)) => {
                name.len() > suffix.len() && name.ends_with(suffix.as_str())
            }
            (Pattern::Subdomains(_), Host::Ip(_)) => false,
        }
    }

    fn names_address(&self, ip: IpAddr, port: u16) -> bool {
        self.explicit
            && self.port.is_none_or(|p| p == port)
            && matches!(self.pattern, Pattern::Exact(Host::Ip(rule_ip)) if rule_ip.to_canonical() == ip.to_canonical())
    }
}

/// A parsed allowlist and the config key it came from.
#[derive(Clone, Debug)]
pub(crate) struct Policy {
    key: String,
    rules: Vec<Rule>,
}

/// A name check that passed: which rule, and whether it names the host explicitly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Listed {
    pub rule: String,
    explicit: bool,
}

impl Policy {
    /// Parses `rules` as written at `key` (e.g. `profiles.local.egress.setup`).
    pub(crate) fn parse<S: AsRef<str>>(
        key: impl Into<String>,
        rules: &[S],
    ) -> Result<Policy, PolicyError> {
        let key = key.into();
        let mut parsed = Vec::new();
        for rule in rules {
            parse_rule(&key, rule.as_ref(), &mut parsed)?;
        }
        Ok(Policy { key, rules: parsed })
    }

    /// Refuses everything; refusals name `key` (e.g. `profiles.local.egress.agent`).
    pub(crate) fn none(key: impl Into<String>) -> Policy {
        Policy {
            key: key.into(),
            rules: Vec::new(),
        }
    }

    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// Is the target's name (or IP literal) and port on the list? An explicit exact rule wins
    /// over a wildcard or preset that also matches.
    pub(crate) fn lookup(&self, target: &Target) -> Result<Listed, Refusal> {
        let mut first = None;
        for rule in self.rules.iter().filter(|r| r.matches(target)) {
            if rule.explicit {
                return Ok(Listed {
                    rule: rule.text.clone(),
                    explicit: true,
                });
            }
            first.get_or_insert(rule);
        }
        first
            .map(|rule| Listed {
                rule: rule.text.clone(),
                explicit: false,
            })
            .ok_or(Refusal::NotListed)
    }

    /// May a listed target connect to these resolved addresses? Every one must be public,
    /// named by the explicit rule that listed the host, or named by an explicit IP rule.
    pub(crate) fn check_addresses(
        &self,
        listed: &Listed,
        port: u16,
        addrs: &[IpAddr],
    ) -> Result<(), Refusal> {
        for &ip in addrs {
            let Some(class) = address::non_public(ip) else {
                continue;
            };
            let named = listed.explicit || self.rules.iter().any(|r| r.names_address(ip, port));
            if !named {
                return Err(Refusal::NonPublic { address: ip, class });
            }
        }
        Ok(())
    }

    /// The one-line body of a 403: what was refused, why, and the exact key and text that
    /// would allow it.
    pub(crate) fn refusal_message(&self, target: &Target, refusal: &Refusal) -> String {
        let key = &self.key;
        let host = &target.host;
        let why = match refusal {
            Refusal::NotListed if self.rules.is_empty() => format!("{key} allows no egress"),
            Refusal::NotListed => format!("not in {key}"),
            Refusal::NonPublic { address, class } => format!(
                "{host} resolves to {address}, {}; only an exact rule naming the host or that \
                 address allows it",
                class.describe()
            ),
        };
        format!("skiff egress: refused {target} ({why}); add \"{host}\" to {key} to allow it")
    }
}

fn parse_rule(key: &str, text: &str, out: &mut Vec<Rule>) -> Result<(), PolicyError> {
    let malformed = |why| PolicyError::Malformed {
        key: key.to_owned(),
        rule: text.to_owned(),
        why,
        known: presets::known(),
    };
    let trimmed = text.trim();
    if let Some(name) = trimmed.strip_prefix("preset:") {
        let preset = presets::find(name).ok_or_else(|| PolicyError::UnknownPreset {
            key: key.to_owned(),
            rule: text.to_owned(),
            known: presets::known(),
        })?;
        for host in preset.hosts {
            let name = target::normalize_name(host).map_err(malformed)?;
            out.push(Rule {
                text: trimmed.to_owned(),
                pattern: Pattern::Exact(Host::Name(name)),
                port: None,
                explicit: false,
            });
        }
        return Ok(());
    }
    if trimmed.contains("://") || trimmed.contains('/') {
        return Err(malformed("it looks like a URL; write only the host"));
    }
    let (host, port) = target::split_port(trimmed).map_err(malformed)?;
    let pattern = if let Some(suffix) = host.strip_prefix("*.") {
        let suffix = target::normalize_name(suffix).map_err(malformed)?;
        Pattern::Subdomains(format!(".{suffix}"))
    } else if host.contains('*') {
        return Err(malformed("a wildcard may only be a leading \"*.\""));
    } else {
        Pattern::Exact(Host::parse(host).map_err(malformed)?)
    };
    let explicit = matches!(pattern, Pattern::Exact(_));
    out.push(Rule {
        text: trimmed.to_owned(),
        pattern,
        port,
        explicit,
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "profiles.local.egress.setup";

    fn policy(rules: &[&str]) -> Policy {
        Policy::parse(KEY, rules).unwrap()
    }

    fn target(s: &str) -> Target {
        Target::parse(s, None).unwrap()
    }

    fn allowed(p: &Policy, t: &str) -> bool {
        p.lookup(&target(t)).is_ok()
    }

    #[test]
    fn the_documented_rule_list_parses_and_matches_as_written() {
        let p = policy(&[
            "preset:python",
            "preset:node",
            "preset:rust",
            "preset:go",
            "preset:debian",
            "git.example.com",
            "*.internal.example",
            "localhost",
            "127.0.0.1:8080",
        ]);
        for ok in [
            "pypi.org:443",
            "files.pythonhosted.org:443",
            "registry.npmjs.org:443",
            "index.crates.io:443",
            "static.crates.io:443",
            "proxy.golang.org:443",
            "deb.debian.org:80",
            "GIT.Example.COM.:22",
            "a.internal.example:443",
            "a.b.internal.example:443",
            "localhost:5000",
            "127.0.0.1:8080",
        ] {
            assert!(allowed(&p, ok), "{ok} should be allowed");
        }
        for refused in [
            "internal.example:443",
            "xinternal.example:443",
            "example.com:443",
            "127.0.0.1:8081",
            "pypi.org.evil.example:443",
            "evilpypi.org:443",
        ] {
            assert!(!allowed(&p, refused), "{refused} should be refused");
        }
        assert_eq!(
            p.lookup(&target("pypi.org:443")).unwrap().rule,
            "preset:python"
        );
    }

    #[test]
    fn ports_and_ip_literals() {
        let p = policy(&["example.com:443", "10.1.2.3", "[fd00::5]:8443", "::1"]);
        assert!(allowed(&p, "example.com:443"));
        assert!(!allowed(&p, "example.com:80"));
        assert!(allowed(&p, "10.1.2.3:9999"));
        assert!(allowed(&p, "[fd00::5]:8443"));
        assert!(!allowed(&p, "[fd00::5]:443"));
        assert!(allowed(&p, "[::1]:1"));
    }

    #[test]
    fn a_bad_rule_is_named_with_its_key_and_the_presets() {
        let err = Policy::parse(KEY, &["pypi.org", "preset:java"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(KEY) && err.contains("\"preset:java\""),
            "{err}"
        );
        assert!(err.contains("preset:python, preset:node, preset:rust, preset:go, preset:debian"));
        for bad in [
            "",
            "https://pypi.org",
            "pypi.org/simple",
            "*",
            "foo.*.com",
            "a b.com",
            "host:0",
            "host:http",
            "[::1",
        ] {
            let err = Policy::parse(KEY, &[bad]).unwrap_err().to_string();
            assert!(
                err.contains(&format!("\"{bad}\"")) && err.contains("preset:go"),
                "{err}"
            );
        }
    }

    #[test]
    fn only_an_explicit_rule_reaches_a_non_public_address() {
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let private: IpAddr = "10.0.0.1".parse().unwrap();
        let public: IpAddr = "151.101.0.223".parse().unwrap();
        let p = policy(&[
            "localhost",
            "*.internal.example",
            "preset:python",
            "10.0.0.1:443",
        ]);
        let check = |t: &str, addrs: &[IpAddr]| {
            let t = target(t);
            let listed = p.lookup(&t).unwrap();
            p.check_addresses(&listed, t.port, addrs)
        };
        assert_eq!(check("localhost:80", &[loopback]), Ok(()));
        assert_eq!(
            check("db.internal.example:80", &[public, loopback]),
            Err(Refusal::NonPublic {
                address: loopback,
                class: AddressClass::Loopback
            })
        );
        assert!(
            check("pypi.org:443", &[private]).is_ok(),
            "named by IP rule"
        );
        assert!(
            check("pypi.org:80", &[private]).is_err(),
            "IP rule is :443 only"
        );
        assert!(check("pypi.org:443", &[public]).is_ok());
    }

    #[test]
    fn refusals_name_the_key_and_what_to_add() {
        let p = policy(&["pypi.org"]);
        let t = target("pypi.example:443");
        assert_eq!(
            p.refusal_message(&t, &Refusal::NotListed),
            "skiff egress: refused pypi.example:443 (not in profiles.local.egress.setup); add \
             \"pypi.example\" to profiles.local.egress.setup to allow it"
        );
        let none = Policy::none("profiles.local.egress.agent");
        assert!(
            none.refusal_message(&t, &Refusal::NotListed)
                .contains("(profiles.local.egress.agent allows no egress)")
        );
        let msg = p.refusal_message(
            &target("pypi.org:443"),
            &Refusal::NonPublic {
                address: "169.254.169.254".parse().unwrap(),
                class: AddressClass::Metadata,
            },
        );
        assert!(
            msg.contains("pypi.org resolves to 169.254.169.254, the cloud metadata address"),
            "{msg}"
        );
    }
}
