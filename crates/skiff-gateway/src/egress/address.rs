//! Which addresses are not the public internet. A name on the allowlist that resolves to one of
//! these is refused unless an exact rule names it: otherwise a wildcard, a preset or a hostile
//! DNS answer would hand a box the gateway's loopback services, its LAN or a cloud metadata
//! endpoint.

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Why an address is not public.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AddressClass {
    Loopback,
    /// RFC 1918, and IPv6 unique-local (fc00::/7) or site-local addresses.
    Private,
    LinkLocal,
    /// 169.254.169.254: the metadata service of every major cloud, which hands out credentials.
    Metadata,
    /// 100.64.0.0/10, carrier-grade NAT (also where some clouds put internal services).
    SharedCgnat,
    Unspecified,
    Multicast,
    Broadcast,
    /// Reserved, documentation or benchmarking ranges: nothing public lives there.
    Reserved,
}

impl AddressClass {
    /// For refusal messages: "… resolves to 10.0.0.1, {a private address}".
    pub(crate) fn describe(self) -> &'static str {
        match self {
            AddressClass::Loopback => "a loopback address",
            AddressClass::Private => "a private address",
            AddressClass::LinkLocal => "a link-local address",
            AddressClass::Metadata => "the cloud metadata address",
            AddressClass::SharedCgnat => "a carrier-grade NAT address",
            AddressClass::Unspecified => "an unspecified address",
            AddressClass::Multicast => "a multicast address",
            AddressClass::Broadcast => "the broadcast address",
            AddressClass::Reserved => "a reserved address",
        }
    }
}

const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// `None` for a public address; otherwise what it is.
pub(crate) fn non_public(ip: IpAddr) -> Option<AddressClass> {
    // ::ffff:10.0.0.1 reaches 10.0.0.1: judge the IPv4 address it stands for.
    match ip.to_canonical() {
        IpAddr::V4(v4) => non_public_v4(v4),
        IpAddr::V6(v6) => non_public_v6(v6),
    }
}

fn non_public_v4(ip: Ipv4Addr) -> Option<AddressClass> {
    let [a, b, c, _] = ip.octets();
    Some(if ip == METADATA {
        AddressClass::Metadata
    } else if a == 0 {
        // Linux connects 0.0.0.0 to the local host; all of 0/8 means "this network".
        AddressClass::Unspecified
    } else if ip.is_loopback() {
        AddressClass::Loopback
    } else if ip.is_private() {
        AddressClass::Private
    } else if ip.is_link_local() {
        AddressClass::LinkLocal
    } else if a == 100 && (b & 0xc0) == 64 {
        AddressClass::SharedCgnat
    } else if ip.is_multicast() {
        AddressClass::Multicast
    } else if ip.is_broadcast() {
        AddressClass::Broadcast
    } else if a >= 240
        || (a, b, c) == (192, 0, 0)
        || (a, b, c) == (192, 0, 2)
        || (a, b, c) == (198, 51, 100)
        || (a, b, c) == (203, 0, 113)
        || (a == 198 && (b & 0xfe) == 18)
    {
        AddressClass::Reserved
    } else {
        return None;
    })
}

fn non_public_v6(ip: Ipv6Addr) -> Option<AddressClass> {
    let s = ip.segments();
    Some(if ip.is_unspecified() {
        AddressClass::Unspecified
    } else if ip.is_loopback() {
        AddressClass::Loopback
    } else if (s[0] & 0xffc0) == 0xfe80 {
        AddressClass::LinkLocal
    } else if (s[0] & 0xfe00) == 0xfc00 || (s[0] & 0xffc0) == 0xfec0 {
        AddressClass::Private
    } else if (s[0] & 0xff00) == 0xff00 {
        AddressClass::Multicast
    } else if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        // NAT64's well-known prefix: the gateway's NAT64 would carry it to the IPv4 address
        // in the low 32 bits.
        let [.., hi, lo] = s;
        let v4 = Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
        return non_public_v4(v4);
    } else if s[..3] == [0x64, 0xff9b, 1] {
        // Local-use NAT64 (RFC 8215): the far side is whatever the operator routes there.
        AddressClass::Private
    } else if s[..6] == [0; 6] || (s[0], s[1]) == (0x2001, 0x0db8) || s[..4] == [0x100, 0, 0, 0] {
        // IPv4-compatible (deprecated), documentation, discard-only.
        AddressClass::Reserved
    } else {
        return None;
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(s: &str) -> Option<AddressClass> {
        non_public(s.parse().unwrap())
    }

    #[test]
    fn every_kind_of_non_public_address_is_named() {
        use AddressClass::*;
        for (addr, want) in [
            ("127.0.0.1", Loopback),
            ("127.8.9.10", Loopback),
            ("::1", Loopback),
            ("10.0.0.1", Private),
            ("172.16.5.4", Private),
            ("192.168.1.1", Private),
            ("fd12:3456::1", Private),
            ("fc00::1", Private),
            ("169.254.10.1", LinkLocal),
            ("fe80::1", LinkLocal),
            ("169.254.169.254", Metadata),
            ("::ffff:169.254.169.254", Metadata),
            ("100.64.0.1", SharedCgnat),
            ("100.127.255.254", SharedCgnat),
            ("0.0.0.0", Unspecified),
            ("0.1.2.3", Unspecified),
            ("::", Unspecified),
            ("224.0.0.1", Multicast),
            ("ff02::1", Multicast),
            ("255.255.255.255", Broadcast),
            ("240.0.0.1", Reserved),
            ("2001:db8::1", Reserved),
            ("::ffff:10.1.2.3", Private),
            ("::ffff:127.0.0.1", Loopback),
            ("64:ff9b::a00:1", Private),
            ("64:ff9b::7f00:1", Loopback),
        ] {
            assert_eq!(class(addr), Some(want), "{addr}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for addr in [
            "151.101.0.223",
            "100.128.0.1",
            "172.32.0.1",
            "8.8.8.8",
            "2a04:4e42::223",
            "64:ff9b::808:808",
            "::ffff:8.8.4.4",
        ] {
            assert_eq!(class(addr), None, "{addr}");
        }
    }
}
