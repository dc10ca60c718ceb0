//! Room in the tables of sign-ins under way. The routes that start a sign-in are public, so a
//! flood of starts must neither grow a table nor lock people out for longer than it has to:
//! entries past their expiry are evicted before a start is counted, and a start that finds the
//! table full is refused (503) with the time until its oldest entry expires (`Retry-After`).

use axum::http::{HeaderValue, header};
use axum::response::Response;
use std::collections::HashMap;

/// A start refused because the table is full: a place frees up in `retry_after_s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Full {
    pub(crate) retry_after_s: u64,
}

impl Full {
    pub(crate) fn message(self) -> String {
        format!(
            "too many sign-ins are under way on this gateway; try again in {} s",
            self.retry_after_s
        )
    }

    /// Says on `resp` when to come back.
    pub(crate) fn retry_after(self, mut resp: Response) -> Response {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(self.retry_after_s));
        resp
    }
}

/// Makes room for one more entry in `map` (at most `max`): what expired by `now` (by
/// `expires_at`, Unix ms) is evicted first; `Full` when no place is free even so.
pub(crate) fn make_room<T>(
    map: &mut HashMap<String, T>,
    max: usize,
    now: i64,
    expires_at: impl Fn(&T) -> i64,
) -> Result<(), Full> {
    map.retain(|_, entry| expires_at(entry) > now);
    if map.len() < max {
        return Ok(());
    }
    let first = map.values().map(&expires_at).min().unwrap_or(now);
    let wait_ms = u64::try_from(first.saturating_sub(now)).unwrap_or(0);
    Err(Full {
        retry_after_s: wait_ms.div_ceil(1000).max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full table refuses the next start, saying when its oldest entry expires; once that
    /// time passes the expired entry is evicted and the start is let in.
    #[test]
    fn a_full_table_refuses_until_its_oldest_entry_expires_then_evicts_it() {
        let mut map: HashMap<String, i64> = HashMap::new();
        for i in 0..3 {
            assert_eq!(make_room(&mut map, 3, 0, |e| *e), Ok(()));
            map.insert(format!("s{i}"), 10_000 + i * 60_000);
        }
        assert_eq!(
            make_room(&mut map, 3, 1_500, |e| *e),
            Err(Full { retry_after_s: 9 })
        );
        assert_eq!(map.len(), 3, "a refused start evicted a live sign-in");
        let full = Full { retry_after_s: 9 };
        let resp = full.retry_after(Response::new(axum::body::Body::empty()));
        assert_eq!(resp.headers()[header::RETRY_AFTER], "9");
        assert!(
            full.message().contains("try again in 9 s"),
            "{}",
            full.message()
        );
        assert_eq!(make_room(&mut map, 3, 10_000, |e| *e), Ok(()));
        assert!(!map.contains_key("s0"), "{map:?}");
        assert_eq!(map.len(), 2);
        // The wait is never zero: a client told to come back at once would hammer.
        map.insert("s3".into(), 10_200);
        assert_eq!(
            make_room(&mut map, 3, 10_100, |e| *e),
            Err(Full { retry_after_s: 1 })
        );
    }
}
