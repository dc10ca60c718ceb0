//! How far a caller sees: only the rows they own, or every row of their tenant. The gateway
//! decides it once per request from the caller's role (`people::Principal::sight`); the lists
//! here take it, and [`Store::owner_of`] finds whose row an id names so the request can then
//! act under that owner's [`Scope`] (rows are always written under their owner's scope).
//! Another tenant's row is never seen, whatever the reach.

use crate::{Result, Scope, Store};
use rusqlite::{OptionalExtension, params};

/// Whose rows a caller sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Only the caller's own (a member).
    Own,
    /// Every row of the caller's tenant (a viewer, an operator, an admin).
    Tenant,
}

/// The caller and how far they see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sight {
    pub scope: Scope,
    pub reach: Reach,
}

impl Sight {
    pub fn own(scope: Scope) -> Self {
        Self {
            scope,
            reach: Reach::Own,
        }
    }

    pub fn tenant(scope: Scope) -> Self {
        Self {
            scope,
            reach: Reach::Tenant,
        }
    }

    pub(crate) fn tenant_wide(&self) -> bool {
        self.reach == Reach::Tenant
    }

    /// Whether rows written under `owner` are in sight.
    pub fn sees(&self, owner: &Scope) -> bool {
        owner.tenant_id == self.scope.tenant_id
            && (self.tenant_wide() || owner.owner_id == self.scope.owner_id)
    }
}

/// The kinds of row a route names by id in its path, each a table with `owner_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owned {
    Session,
    Environment,
    Snapshot,
    Group,
    Approval,
}

impl Owned {
    pub(crate) fn table(self) -> &'static str {
        match self {
            Owned::Session => "sessions",
            Owned::Environment => "environments",
            Owned::Snapshot => "snapshots",
            Owned::Group => "session_groups",
            Owned::Approval => "approvals",
        }
    }

    /// The row in words, for a refusal.
    pub fn noun(self) -> &'static str {
        match self {
            Owned::Session => "session",
            Owned::Environment => "environment",
            Owned::Snapshot => "snapshot",
            Owned::Group => "group",
            Owned::Approval => "approval",
        }
    }
}

/// The SQL condition for "the sight sees this row", with the row's owner and tenant columns
/// and the sight's owner, tenant and reach bound at `?o`, `?o+1`, `?o+2`.
pub(crate) fn seen(alias: &str, o: usize) -> String {
    let p = if alias.is_empty() {
        String::new()
    } else {
        format!("{alias}.")
    };
    format!(
        "{p}tenant_id = ?{t} AND ({p}owner_id = ?{o} OR ?{r} = 1)",
        t = o + 1,
        r = o + 2
    )
}

impl Store {
    /// The owner's scope of the `kind` row `id` when the sight sees it; `None` when there is
    /// no such row in the caller's tenant or it is another user's and the sight is the
    /// caller's own.
    pub fn owner_of(&self, sight: &Sight, kind: Owned, id: &str) -> Result<Option<Scope>> {
        let sql = format!(
            "SELECT owner_id, tenant_id FROM {} WHERE id = ?1 AND {}",
            kind.table(),
            seen("", 2)
        );
        Ok(self
            .conn()
            .prepare_cached(&sql)?
            .query_row(
                params![
                    id,
                    sight.scope.owner_id,
                    sight.scope.tenant_id,
                    sight.tenant_wide()
                ],
                |r| Ok(Scope::new(r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )
            .optional()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::plain_session_for_tests;

    #[test]
    fn a_tenant_wide_sight_finds_its_tenants_rows_and_an_own_sight_only_its_own() {
        let store = Store::open_in_memory().unwrap();
        let ana = Scope::new("usr_ana", "alpha");
        let carl = Scope::new("usr_carl", "alpha");
        let bert = Scope::new("usr_bert", "beta");
        let anas = plain_session_for_tests(&store, &ana);
        let id = anas.as_str();

        let own = |s: &Scope| Sight::own(s.clone());
        let wide = |s: &Scope| Sight::tenant(s.clone());
        assert_eq!(
            store.owner_of(&own(&ana), Owned::Session, id).unwrap(),
            Some(ana.clone())
        );
        assert_eq!(
            store.owner_of(&own(&carl), Owned::Session, id).unwrap(),
            None
        );
        assert_eq!(
            store.owner_of(&wide(&carl), Owned::Session, id).unwrap(),
            Some(ana.clone()),
            "a viewer of alpha finds ana's session and whose it is"
        );
        assert_eq!(
            store.owner_of(&wide(&bert), Owned::Session, id).unwrap(),
            None,
            "another tenant never does"
        );
        assert_eq!(
            store
                .owner_of(&wide(&carl), Owned::Environment, id)
                .unwrap(),
            None,
            "an id is looked up among its own kind only"
        );

        let listed = |s: &Sight| -> Vec<String> {
            store
                .session_page(s, 10, None)
                .unwrap()
                .into_iter()
                .map(|r| r.session.id.to_string())
                .collect()
        };
        assert_eq!(listed(&own(&carl)), Vec::<String>::new());
        assert_eq!(listed(&wide(&carl)), vec![anas.to_string()]);
        assert_eq!(listed(&wide(&bert)), Vec::<String>::new());
        let row = &store.session_page(&wide(&carl), 10, None).unwrap()[0];
        assert_eq!(row.session.owner, ana, "a listed row says whose it is");
    }
}
