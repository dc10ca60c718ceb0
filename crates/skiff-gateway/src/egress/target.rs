//! Where a box asks to go: a host (name or IP literal) and a port, normalised the same way for
//! rules and for requests, so `PyPI.org.` on the wire meets `pypi.org` in the config.

use std::fmt;
use std::net::IpAddr;

/// A host as written in a rule or a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Host {
    /// Lowercase, without a trailing dot.
    Name(String),
    Ip(IpAddr),
}

impl Host {
    /// A host as it appears in an authority: `name`, `1.2.3.4` or `[v6]` (brackets optional
    /// for a bare IPv6 literal in config).
    pub(crate) fn parse(text: &str) -> Result<Host, &'static str> {
        if let Some(inner) = text.strip_prefix('[') {
            let inner = inner
                .strip_suffix(']')
                .ok_or("an IPv6 address in brackets needs its closing \"]\"")?;
            return inner
                .parse::<std::net::Ipv6Addr>()
                .map(|ip| Host::Ip(IpAddr::V6(ip)))
                .map_err(|_| "the text in brackets is not an IPv6 address");
        }
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(Host::Ip(ip));
        }
        normalize_name(text).map(Host::Name)
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Name(name) => f.write_str(name),
            Host::Ip(IpAddr::V4(ip)) => write!(f, "{ip}"),
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
        }
    }
}

/// A DNS name, lowercased, one trailing dot dropped. Only letters, digits, `-` and `_` in
/// labels of 1 to 63 characters: what a proxy request may name is also what goes into a
/// response header and a refusal message, so nothing else gets through.
pub(crate) fn normalize_name(text: &str) -> Result<String, &'static str> {
    let name = text.strip_suffix('.').unwrap_or(text);
    if name.is_empty() {
        return Err("the host is empty");
    }
    if name.len() > 253 {
        return Err("the host name is longer than 253 characters");
    }
    if !name.is_ascii() {
        return Err("the host is not ASCII (write an internationalised name in its xn-- form)");
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("a label of the host name is empty or longer than 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(
                "the host name holds a character other than letters, digits, '-', '_' and '.'",
            );
        }
    }
    Ok(name.to_ascii_lowercase())
}

/// A host and port a box asked for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Target {
    pub host: Host,
    pub port: u16,
}

impl Target {
    /// `host:port` (`[v6]:port`); without a port, `default_port` when given.
    pub(crate) fn parse(
        authority: &str,
        default_port: Option<u16>,
    ) -> Result<Target, &'static str> {
        let (host, port) = split_port(authority)?;
        let port = match port {
            Some(port) => port,
            None => default_port.ok_or("the target has no port")?,
        };
        Ok(Target {
            host: Host::parse(host)?,
            port,
        })
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Splits `host[:port]`, `[v6][:port]` or a bare IPv6 literal (many colons, no port).
pub(crate) fn split_port(text: &str) -> Result<(&str, Option<u16>), &'static str> {
    let (host, port) = if text.starts_with('[') {
        match text.find(']') {
            Some(end) => match &text[end + 1..] {
                "" => (text, None),
                rest => (
                    &text[..=end],
                    Some(rest.strip_prefix(':').ok_or("text follows the \"]\"")?),
                ),
            },
            None => return Err("an IPv6 address in brackets needs its closing \"]\""),
        }
    } else {
        match text.matches(':').count() {
            0 => (text, None),
            1 => match text.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (text, None),
            },
            _ => (text, None),
        }
    };
    let port = match port {
        None => None,
        Some(port) => match port.parse::<u16>() {
            Ok(0) | Err(_) => return Err("the port is not a number from 1 to 65535"),
            Ok(n) => Some(n),
        },
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_normalise_the_way_rules_do() {
        let t = Target::parse("PyPI.org.:443", None).unwrap();
        assert_eq!(t.host, Host::Name("pypi.org".into()));
        assert_eq!(t.to_string(), "pypi.org:443");
        assert_eq!(
            Target::parse("[::1]:8080", None).unwrap().to_string(),
            "[::1]:8080"
        );
        assert_eq!(
            Target::parse("example.com", Some(80)).unwrap().to_string(),
            "example.com:80"
        );
        assert!(Target::parse("example.com", None).is_err());
        assert!(Target::parse("exa mple.com:80", None).is_err());
        assert!(Target::parse("a.com:0", None).is_err());
        assert!(Target::parse("a.com:99999", None).is_err());
        assert!(Target::parse("a.com\r\nX-Evil: 1:80", None).is_err());
        assert!(Target::parse("[::1:80", None).is_err());
    }
}
