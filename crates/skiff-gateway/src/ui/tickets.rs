//! One-use login tickets: `skiff ui` asks for one with its bearer token and prints a link that
//! carries it; the browser trades it once for a session cookie. Tickets live in memory only
//! (a restart voids every outstanding link, which is harmless: they last a minute).
//!
//! Deliberately absent: any way to read a ticket back, or to use one twice.

use skiff_store::Scope;
use std::collections::HashMap;
use std::sync::Mutex;

/// How long a login link works.
pub(crate) const TICKET_TTL_MS: i64 = 60_000;
/// Outstanding tickets kept at most; minting beyond it drops the oldest. A bound, so that a
/// script calling `POST /v1/ui/tickets` in a loop cannot grow the gateway's memory.
const MAX_PENDING: usize = 64;

#[derive(Default)]
pub(crate) struct Tickets {
    /// Keyed by the ticket's blake3 hash: the plaintext is never kept, and a lookup's timing
    /// depends on the hash, which tells an attacker nothing about other tickets.
    pending: Mutex<HashMap<[u8; 32], (Scope, i64)>>,
}

impl Tickets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], (Scope, i64)>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Mints a ticket for `scope`, valid until the returned instant (Unix ms).
    pub(crate) fn mint(
        &self,
        scope: &Scope,
        now_ms: i64,
    ) -> Result<(String, i64), skiff_store::Error> {
        let ticket = format!("skt_{}{}", skiff_store::mint()?, skiff_store::mint()?);
        let expires_at_ms = now_ms + TICKET_TTL_MS;
        let mut pending = self.lock();
        pending.retain(|_, (_, expires)| *expires > now_ms);
        while pending.len() >= MAX_PENDING {
            let oldest = pending
                .iter()
                .min_by_key(|(_, (_, expires))| *expires)
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => pending.remove(&k),
                None => break,
            };
        }
        pending.insert(
            *blake3::hash(ticket.as_bytes()).as_bytes(),
            (scope.clone(), expires_at_ms),
        );
        Ok((ticket, expires_at_ms))
    }

    /// Trades a ticket for its scope. The ticket is gone afterwards, used or expired.
    pub(crate) fn redeem(&self, ticket: &str, now_ms: i64) -> Option<Scope> {
        let key = *blake3::hash(ticket.as_bytes()).as_bytes();
        let (scope, expires_at_ms) = self.lock().remove(&key)?;
        (expires_at_ms > now_ms).then_some(scope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_works_once() {
        let tickets = Tickets::default();
        let scope = Scope::new("usr_a", "ten_a");
        let (ticket, _) = tickets.mint(&scope, 1_000).unwrap();
        assert_eq!(tickets.redeem(&ticket, 1_001), Some(scope));
        assert_eq!(tickets.redeem(&ticket, 1_002), None);
    }

    #[test]
    fn a_ticket_expires_after_its_ttl() {
        let tickets = Tickets::default();
        let (ticket, expires) = tickets.mint(&Scope::new("usr_a", "ten_a"), 1_000).unwrap();
        assert_eq!(expires, 1_000 + TICKET_TTL_MS);
        assert_eq!(tickets.redeem(&ticket, expires), None);
        // And an expired ticket is not kept for a second try either.
        assert!(tickets.lock().is_empty());
    }

    #[test]
    fn outstanding_tickets_are_bounded() {
        let tickets = Tickets::default();
        let scope = Scope::new("usr_a", "ten_a");
        let (first, _) = tickets.mint(&scope, 1_000).unwrap();
        for i in 0..MAX_PENDING as i64 {
            tickets.mint(&scope, 1_001 + i).unwrap();
        }
        assert_eq!(tickets.lock().len(), MAX_PENDING);
        assert_eq!(
            tickets.redeem(&first, 2_000),
            None,
            "the oldest was dropped"
        );
    }

    #[test]
    fn an_unknown_ticket_is_refused() {
        assert_eq!(Tickets::default().redeem("skt_nope", 0), None);
    }
}
