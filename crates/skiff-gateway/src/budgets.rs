//! Token and cost budgets (`[budgets]`, `[profiles.NAME.budgets]`): per session over its life,
//! per user (a scope's owner) and per tenant per UTC day. Every model call of a session — its
//! loop on the gateway, its loop on a worker through the inference proxy, a compaction — goes
//! through [`Core::model_stream`], which checks the budgets before the provider is asked: an
//! exhausted budget ends the call with an error naming the budget, its limit, what was used
//! and the key that raises it, and the turn ends with that notice. Usage is recorded with each
//! model response's transcript entry ([`Core::record_usage`]) in the store's usage ledger.
//!
//! Deliberately absent: reservations. A call that starts under its budget may finish past it
//! (a budget is checked, not metered mid-stream); the next call is the one refused.

use crate::Core;
use crate::config::ConfigError;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use skiff_llm::CacheKey;
use skiff_protocol::budget::{BudgetSubject, UsageLine, UsageReport};
use skiff_protocol::environment::PlacementState;
use skiff_protocol::model::{ModelErrorKind, ModelEvent, ModelRef, ModelRequest, Usage};
use skiff_protocol::{RunId, SessionId};
use skiff_providers::{BudgetsConfig, ProfileConfig};
use skiff_store::{DAY_MS, Scope, Used};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// One configured limit and the key that set it (what a refusal tells people to raise).
#[derive(Clone, Debug, PartialEq)]
struct Limit<T> {
    value: T,
    key: String,
}

/// The limits in force for one session's calls.
#[derive(Clone, Debug, Default, PartialEq)]
struct Limits {
    session_tokens: Option<Limit<u64>>,
    session_cost_usd: Option<Limit<f64>>,
    user_tokens: Option<Limit<u64>>,
    user_cost_usd: Option<Limit<f64>>,
    tenant_tokens: Option<Limit<u64>>,
    tenant_cost_usd: Option<Limit<f64>>,
}

impl Limits {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// `config`'s limits (keys under `prefix`) over `self`'s.
    fn overlaid(mut self, prefix: &str, config: &BudgetsConfig) -> Self {
        fn pick<T: Copy>(slot: &mut Option<Limit<T>>, value: Option<T>, key: String) {
            if let Some(value) = value {
                *slot = Some(Limit { value, key });
            }
        }
        let key = |name: &str| format!("{prefix}{name}");
        pick(
            &mut self.session_tokens,
            config.session_tokens,
            key("session_tokens"),
        );
        pick(
            &mut self.session_cost_usd,
            config.session_cost_usd,
            key("session_cost_usd"),
        );
        pick(
            &mut self.user_tokens,
            config.user_tokens_per_day,
            key("user_tokens_per_day"),
        );
        pick(
            &mut self.user_cost_usd,
            config.user_cost_usd_per_day,
            key("user_cost_usd_per_day"),
        );
        pick(
            &mut self.tenant_tokens,
            config.tenant_tokens_per_day,
            key("tenant_tokens_per_day"),
        );
        pick(
            &mut self.tenant_cost_usd,
            config.tenant_cost_usd_per_day,
            key("tenant_cost_usd_per_day"),
        );
        self
    }
}

/// The validated budgets: the gateway's and each profile's overrides.
#[derive(Debug, Default)]
pub(crate) struct Budgets {
    default: Limits,
    profiles: BTreeMap<String, Limits>,
}

/// A bad limit fails the gateway's start, naming its key.
fn check(config_path: &Path, prefix: &str, config: &BudgetsConfig) -> Result<(), ConfigError> {
    let invalid = |name: &str, what: String| ConfigError::Invalid {
        path: config_path.display().to_string(),
        message: format!("at `{prefix}{name}`: {what}"),
    };
    for (name, value) in [
        ("session_tokens", config.session_tokens),
        ("user_tokens_per_day", config.user_tokens_per_day),
        ("tenant_tokens_per_day", config.tenant_tokens_per_day),
    ] {
        if value == Some(0) {
            return Err(invalid(
                name,
                "0 is not a limit: give a positive number of tokens, or leave the key out for none"
                    .into(),
            ));
        }
    }
    for (name, value) in [
        ("session_cost_usd", config.session_cost_usd),
        ("user_cost_usd_per_day", config.user_cost_usd_per_day),
        ("tenant_cost_usd_per_day", config.tenant_cost_usd_per_day),
    ] {
        if let Some(value) = value
            && !(value.is_finite() && value > 0.0)
        {
            return Err(invalid(
                name,
                format!(
                    "{value} is not a limit: give a positive amount of US dollars like 5.0, or leave the key out for none"
                ),
            ));
        }
    }
    Ok(())
}

impl Budgets {
    pub(crate) fn from_config(
        config_path: &Path,
        budgets: &BudgetsConfig,
        profiles: &BTreeMap<String, ProfileConfig>,
    ) -> Result<Self, ConfigError> {
        check(config_path, "budgets.", budgets)?;
        let default = Limits::default().overlaid("budgets.", budgets);
        let mut by_profile = BTreeMap::new();
        for (name, profile) in profiles {
            let prefix = format!("profiles.{name}.budgets.");
            check(config_path, &prefix, &profile.budgets)?;
            by_profile.insert(
                name.clone(),
                default.clone().overlaid(&prefix, &profile.budgets),
            );
        }
        Ok(Self {
            default,
            profiles: by_profile,
        })
    }

    fn limits(&self, profile: Option<&str>) -> &Limits {
        profile
            .and_then(|p| self.profiles.get(p))
            .unwrap_or(&self.default)
    }
}

/// The start of the UTC day `now_ms` falls in.
fn day_start(now_ms: i64) -> i64 {
    now_ms - now_ms.rem_euclid(DAY_MS)
}

/// `2026-12-02` for a moment in that UTC day.
pub(crate) fn utc_day(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let text = humantime::format_rfc3339_seconds(at).to_string();
    text.get(..10).unwrap_or(&text).to_owned()
}

fn line(
    subject: BudgetSubject,
    id: &str,
    window: &str,
    used: Used,
    tokens: Option<&Limit<u64>>,
    cost: Option<&Limit<f64>>,
) -> UsageLine {
    let exhausted = tokens.is_some_and(|l| used.tokens >= l.value)
        || cost.is_some_and(|l| used.cost_usd >= l.value);
    UsageLine {
        subject,
        id: id.to_owned(),
        window: window.to_owned(),
        tokens: used.tokens,
        cost_usd: used.cost_usd,
        tokens_limit: tokens.map(|l| l.value),
        cost_usd_limit: cost.map(|l| l.value),
        exhausted,
    }
}

/// Why a call is refused: the first exhausted budget, in words a person can act on.
fn refusal(lines: &[UsageLine], limits: &Limits) -> Option<(String, serde_json::Value)> {
    for l in lines.iter().filter(|l| l.exhausted) {
        let (tokens, cost, whose, window) = match l.subject {
            BudgetSubject::Session => (
                &limits.session_tokens,
                &limits.session_cost_usd,
                format!("session {}", l.id),
                "over its life".to_owned(),
            ),
            BudgetSubject::User => (
                &limits.user_tokens,
                &limits.user_cost_usd,
                format!("user {}", l.id),
                format!("on {} (UTC)", l.window),
            ),
            BudgetSubject::Tenant => (
                &limits.tenant_tokens,
                &limits.tenant_cost_usd,
                format!("tenant {}", l.id),
                format!("on {} (UTC)", l.window),
            ),
        };
        let (what, used, limit, key) = match (tokens, cost) {
            (Some(t), _) if l.tokens >= t.value => (
                "token",
                format!("{} tokens", l.tokens),
                format!("{} tokens", t.value),
                t.key.clone(),
            ),
            (_, Some(c)) => (
                "cost",
                format!("${:.4}", l.cost_usd),
                format!("${:.4}", c.value),
                c.key.clone(),
            ),
            _ => continue,
        };
        let wait = if l.subject == BudgetSubject::Session {
            ""
        } else {
            ", or wait for the next UTC day"
        };
        let message = format!(
            "budget exhausted: the {} {what} budget `{key}` is used up — {whose} used {used} {window}, the limit is {limit}; the model was not asked. Raise `{key}` in the gateway's skiff.toml and restart the gateway{wait}",
            l.subject.as_str()
        );
        let detail = serde_json::json!({
            "budget": key, "subject": l.subject.as_str(), "id": l.id, "window": l.window,
            "tokens": l.tokens, "cost_usd": l.cost_usd,
        });
        return Some((message, detail));
    }
    None
}

impl Core {
    /// The profile whose budgets a session's calls count against: its worker profile while it
    /// is placed on one, none at home.
    fn budget_profile(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> skiff_store::Result<Option<String>> {
        let row = self.store.session(scope, session)?;
        if row.placement == PlacementState::Local.as_str() {
            return Ok(None);
        }
        Ok(self.store.placement(scope, session)?.map(|p| p.profile))
    }

    /// Session, user and tenant usage against the limits in force for `session`'s calls.
    fn lines_for(
        &self,
        scope: &Scope,
        session: &SessionId,
        limits: &Limits,
    ) -> skiff_store::Result<Vec<UsageLine>> {
        let now = skiff_store::now_ms();
        let day = utc_day(now);
        let since = day_start(now);
        Ok(vec![
            line(
                BudgetSubject::Session,
                session.as_str(),
                "session",
                self.store.session_usage(scope, session)?,
                limits.session_tokens.as_ref(),
                limits.session_cost_usd.as_ref(),
            ),
            line(
                BudgetSubject::User,
                &scope.owner_id,
                &day,
                self.store.user_usage(scope, since)?,
                limits.user_tokens.as_ref(),
                limits.user_cost_usd.as_ref(),
            ),
            line(
                BudgetSubject::Tenant,
                &scope.tenant_id,
                &day,
                self.store.tenant_usage(scope, since)?,
                limits.tenant_tokens.as_ref(),
                limits.tenant_cost_usd.as_ref(),
            ),
        ])
    }

    /// What `session show` and the UI print: the session's, its user's and its tenant's
    /// usage against the budgets in force for it.
    pub(crate) fn usage_lines(
        &self,
        scope: &Scope,
        session: &SessionId,
    ) -> crate::Result<Vec<UsageLine>> {
        let profile = self.budget_profile(scope, session)?;
        let limits = self.budgets.limits(profile.as_deref());
        Ok(self.lines_for(scope, session, limits)?)
    }

    /// Why `session`'s next model call may not start, or `None` when every budget has room.
    fn budget_refusal(&self, scope: &Scope, session: &SessionId) -> Option<String> {
        let checked = self.budget_profile(scope, session).and_then(|profile| {
            let limits = self.budgets.limits(profile.as_deref());
            if limits.is_empty() {
                return Ok(None);
            }
            let lines = self.lines_for(scope, session, limits)?;
            Ok(refusal(&lines, limits))
        });
        match checked {
            Ok(None) => None,
            Ok(Some((message, detail))) => {
                self.audit(
                    scope,
                    "budget.exhausted",
                    session.as_str(),
                    "refused",
                    detail,
                );
                Some(message)
            }
            // A budget that cannot be read is not taken for one with room.
            Err(e) => Some(format!(
                "could not read this session's usage to check its budgets ({e}); the model was not asked"
            )),
        }
    }

    /// The one way a session's model call starts, whatever its placement: budgets checked
    /// first, then the catalog with the session's prompt-cache key.
    pub(crate) fn model_stream(
        &self,
        scope: &Scope,
        session: &SessionId,
        request: ModelRequest,
        cache_key: CacheKey,
        cancel: CancellationToken,
    ) -> BoxStream<'static, ModelEvent> {
        if let Some(message) = self.budget_refusal(scope, session) {
            return futures_util::stream::iter([ModelEvent::Error {
                kind: ModelErrorKind::BudgetExhausted,
                message,
            }])
            .boxed();
        }
        self.catalog.stream(request, Some(cache_key), cancel)
    }

    /// Adds a model response's usage to its run and to the usage ledger, costed at the
    /// session model's prices now.
    pub(crate) fn record_usage(
        &self,
        scope: &Scope,
        session: &SessionId,
        run: &RunId,
        usage: Usage,
    ) -> crate::Result<()> {
        let model = self.store.session(scope, session)?.model_ref;
        let cost = ModelRef::parse(&model)
            .and_then(|m| self.catalog.prices(&m))
            .map(|prices| prices.cost_usd(&usage))
            .unwrap_or(0.0);
        self.store.add_run_usage(scope, run, usage, cost)?;
        Ok(())
    }

    /// `GET /v1/admin/usage`: every user and tenant that used a model today, and every
    /// session that did (over its life), against the limits in force.
    fn usage_report(&self) -> crate::Result<UsageReport> {
        let now = skiff_store::now_ms();
        let day = utc_day(now);
        let rows = self.store.usage_since(day_start(now))?;
        let limits = &self.budgets.default;
        let mut lines = Vec::new();
        let mut tenants: BTreeMap<String, Used> = BTreeMap::new();
        for row in rows.iter().filter(|r| r.session_id.is_none()) {
            lines.push(line(
                BudgetSubject::User,
                &row.owner_id,
                &day,
                row.used,
                limits.user_tokens.as_ref(),
                limits.user_cost_usd.as_ref(),
            ));
            let tenant = tenants.entry(row.tenant_id.clone()).or_default();
            tenant.tokens += row.used.tokens;
            tenant.cost_usd += row.used.cost_usd;
        }
        for (tenant, used) in &tenants {
            lines.push(line(
                BudgetSubject::Tenant,
                tenant,
                &day,
                *used,
                limits.tenant_tokens.as_ref(),
                limits.tenant_cost_usd.as_ref(),
            ));
        }
        for row in &rows {
            let Some(id) = row.session_id.as_deref() else {
                continue;
            };
            let scope = Scope::new(row.owner_id.clone(), row.tenant_id.clone());
            let profile = SessionId::parse(id)
                .and_then(|s| self.budget_profile(&scope, &s).ok())
                .flatten();
            let limits = self.budgets.limits(profile.as_deref());
            lines.push(line(
                BudgetSubject::Session,
                id,
                "session",
                row.used,
                limits.session_tokens.as_ref(),
                limits.session_cost_usd.as_ref(),
            ));
        }
        Ok(UsageReport { day, lines })
    }
}

pub(crate) fn routes() -> crate::people::Routes {
    crate::people::Routes::new().route("/v1/admin/usage", get(usage))
}

async fn usage(
    State(core): State<Arc<Core>>,
    Extension(scope): Extension<Scope>,
) -> crate::Result<Response> {
    crate::audit_trail::admin_only(&core, &scope, "usage.read")?;
    Ok(Json(core.usage_report()?).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Budgets, String> {
        let config = crate::config::Config::parse(text)?;
        Budgets::from_config(Path::new("skiff.toml"), &config.budgets, &config.profiles)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn bad_limits_fail_naming_their_key() {
        let err = parse("[budgets]\nsession_cost_usd = -1.0\n").unwrap_err();
        assert!(err.contains("`budgets.session_cost_usd`"), "{err}");
        let err = parse("[budgets]\nuser_tokens_per_day = 0\n").unwrap_err();
        assert!(err.contains("`budgets.user_tokens_per_day`"), "{err}");
        let err = parse(
            "[profiles.big]\nprovider = \"local\"\n[profiles.big.budgets]\ntenant_cost_usd_per_day = nan\n",
        )
        .unwrap_err();
        assert!(
            err.contains("`profiles.big.budgets.tenant_cost_usd_per_day`"),
            "{err}"
        );
        let err = crate::config::Config::parse("[budgets]\nsession_tokens = -5\n").unwrap_err();
        assert!(err.contains("budgets.session_tokens"), "{err}");
        let err = crate::config::Config::parse("[budgets]\nsesion_tokens = 5\n").unwrap_err();
        assert!(err.contains("sesion_tokens"), "{err}");
    }

    #[test]
    fn a_profile_overrides_each_key_it_names() {
        let budgets = parse(
            "[budgets]\nsession_tokens = 100\nuser_tokens_per_day = 1000\n\
             [profiles.big]\nprovider = \"local\"\n[profiles.big.budgets]\nsession_tokens = 500\n",
        )
        .unwrap();
        let big = budgets.limits(Some("big"));
        assert_eq!(
            big.session_tokens,
            Some(Limit {
                value: 500,
                key: "profiles.big.budgets.session_tokens".into()
            })
        );
        assert_eq!(
            big.user_tokens.as_ref().map(|l| l.key.as_str()),
            Some("budgets.user_tokens_per_day")
        );
        assert_eq!(
            budgets.limits(None).session_tokens.as_ref().unwrap().value,
            100
        );
    }

    #[test]
    fn days_are_utc() {
        assert_eq!(utc_day(0), "1970-01-01");
        assert_eq!(utc_day(DAY_MS - 1), "1970-01-01");
        assert_eq!(day_start(DAY_MS + 5), DAY_MS);
    }
}
