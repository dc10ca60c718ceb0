//! People and roles: who a request is (`Principal`: a user with a role in a tenant, and the
//! scope of the token they presented), what each route needs (`ACCESS`, one table the router is
//! checked against), the gate that refuses what the role or token cannot do, and the admin's
//! routes for users and tokens (`/v1/admin/users`, `/v1/admin/tokens`) and `/v1/me`.
//!
//! How far a caller sees is decided here too (`Principal::sight`): a member sees only their own
//! rows, a viewer, an operator and an admin every row of their tenant. For a route that names a
//! row in its path, the gate finds whose row it is within that sight and hands the handler the
//! owner's `Scope` (so everything the request writes stays the owner's), after checking the
//! route's rule lets the caller act on someone else's row (`Rule::others`). A row the caller
//! cannot see — another tenant's, or another member's for a member — is left to the handler,
//! which reads under the caller's own `Scope` and answers "not found".

use crate::Core;
use crate::error::Error;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get};
use axum::{Extension, Json, Router};
use serde_json::json;
use skiff_protocol::people::{
    AddUserRequest, CreateTokenRequest, CreatedToken, Me, Role, TokenList, TokenScope, TokenView,
    UserList, UserView,
};
use skiff_store::{DEFAULT_TENANT, FIRST_ADMIN, Owned, Scope, Sight, TokenRow, UserRow};
use std::sync::Arc;

/// The longest a token may live: a year.
pub const MAX_TOKEN_LIFETIME_S: u64 = 366 * 24 * 3600;

/// What a route needs, in increasing order: each level includes the ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Read the caller's own rows.
    Read,
    /// Create and drive the caller's own sessions.
    Write,
    /// Manage environments and snapshots (an operator).
    Operate,
    /// Manage the users and tokens of the caller's tenant (an admin).
    Admin,
    /// The gateway's own state across tenants: the vault, the audit trail, usage, metrics,
    /// the orphan sweep (an admin of the first tenant).
    Gateway,
}

impl Need {
    /// What a refused caller could not do, in words.
    fn action(self) -> &'static str {
        match self {
            Need::Read => "read this",
            Need::Write => "change this",
            Need::Operate => "manage environments and profiles",
            Need::Admin => "manage users and tokens",
            Need::Gateway => "manage the gateway (vault, audit, usage, metrics)",
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Need::Read => "read",
            Need::Write => "write",
            Need::Operate => "operate",
            Need::Admin => "admin",
            Need::Gateway => "gateway",
        }
    }
}

/// What a route touches, which is what the whole-router test checks for each caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The caller's own state (`/v1/health`, `/v1/me`, a login ticket).
    Own,
    /// A list of the caller's rows: another scope's never appear.
    Collection,
    /// Makes a row in the caller's scope.
    Create,
    /// One row named in the path: another scope's is "not found".
    Row,
    /// Gateway-wide state: refused to everyone but the gateway's admins.
    Gateway,
}

/// One route's rule.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub method: &'static str,
    pub path: &'static str,
    pub need: Need,
    pub kind: Kind,
    /// For a `Row` route, what using it on another user's row of the tenant needs; `None`:
    /// only the row's owner may (driving a session is its owner's). Reading needs only to
    /// see the row; operating one (cancel, pull back, dispatch, decide an approval, manage
    /// a box) needs an operator.
    pub others: Option<Need>,
}

const fn rule(method: &'static str, path: &'static str, need: Need, kind: Kind) -> Rule {
    Rule {
        method,
        path,
        need,
        kind,
        others: match need {
            Write => None,
            _ => Some(need),
        },
    }
}

/// A member's write on their own row that an operator may also make on anyone's in the tenant.
const fn operate(method: &'static str, path: &'static str) -> Rule {
    Rule {
        method,
        path,
        need: Write,
        kind: Kind::Row,
        others: Some(Operate),
    }
}

use Kind::{Collection, Create, Gateway as Wide, Own, Row};
use Need::{Admin, Gateway, Operate, Read, Write};

/// Every authenticated route and what it needs. A route the router has and this table lacks is
/// refused to everyone (and fails the whole-router test).
pub const ACCESS: &[Rule] = &[
    rule("GET", "/v1/health", Read, Own),
    rule("GET", "/v1/me", Read, Own),
    rule("GET", "/metrics", Gateway, Wide),
    rule("POST", "/v1/gateway/drain", Gateway, Wide),
    rule("GET", "/v1/sessions", Read, Collection),
    rule("POST", "/v1/sessions", Write, Create),
    rule("GET", "/v1/sessions/{id}", Read, Row),
    rule("POST", "/v1/sessions/{id}/messages", Write, Row),
    rule("POST", "/v1/sessions/{id}/agent", Write, Row),
    operate("POST", "/v1/sessions/{id}/cancel"),
    operate("POST", "/v1/sessions/{id}/pull-back"),
    operate("POST", "/v1/sessions/{id}/dispatch"),
    rule("GET", "/v1/sessions/{id}/events", Read, Row),
    rule("GET", "/v1/sessions/{id}/events/ws", Read, Row),
    rule("GET", "/v1/events", Read, Collection),
    rule("POST", "/v1/ui/tickets", Read, Own),
    rule("GET", "/v1/profiles", Read, Collection),
    rule("GET", "/v1/environments", Read, Collection),
    rule("POST", "/v1/environments", Operate, Create),
    rule("POST", "/v1/environments/sweep", Gateway, Wide),
    rule("GET", "/v1/environments/{id}", Read, Row),
    rule("DELETE", "/v1/environments/{id}", Operate, Row),
    rule("POST", "/v1/environments/{id}/check", Operate, Row),
    rule("POST", "/v1/environments/{id}/exec", Operate, Row),
    rule("POST", "/v1/environments/{id}/snapshot", Operate, Row),
    rule("GET", "/v1/snapshots", Read, Collection),
    rule("DELETE", "/v1/snapshots/{id}", Operate, Row),
    rule("GET", "/v1/sessions/{id}/checkpoints", Read, Row),
    rule("POST", "/v1/sessions/{id}/publish", Write, Row),
    rule("GET", "/v1/sessions/{id}/quarantine", Read, Row),
    rule("POST", "/v1/sessions/{id}/quarantine/accept", Write, Row),
    rule("POST", "/v1/sessions/{id}/quarantine/discard", Write, Row),
    rule("GET", "/v1/sessions/{id}/diff", Read, Row),
    rule("GET", "/v1/sessions/{id}/runs/{run}/changes", Read, Row),
    rule("POST", "/v1/sessions/{id}/apply", Write, Row),
    rule("POST", "/v1/sessions/{id}/export", Write, Row),
    rule("GET", "/v1/sessions/{id}/setup-log", Read, Row),
    rule("POST", "/v1/sessions/{id}/restore", Write, Row),
    rule("POST", "/v1/sessions/{id}/fork", Write, Row),
    rule("GET", "/v1/groups/{id}", Read, Row),
    rule("POST", "/v1/sessions/{id}/pick", Write, Row),
    rule("POST", "/v1/sessions/{id}/compact", Write, Row),
    rule("GET", "/v1/secrets", Gateway, Wide),
    rule("POST", "/v1/secrets/rotate-key", Gateway, Wide),
    rule("PUT", "/v1/secrets/{name}", Gateway, Wide),
    rule("DELETE", "/v1/secrets/{name}", Gateway, Wide),
    rule("GET", "/v1/approvals", Read, Collection),
    rule("GET", "/v1/approvals/{id}", Read, Row),
    operate("POST", "/v1/approvals/{id}/approve"),
    operate("POST", "/v1/approvals/{id}/deny"),
    rule("GET", "/v1/admin/usage", Gateway, Wide),
    rule("GET", "/v1/audit/tail", Gateway, Wide),
    rule("GET", "/v1/audit/export", Gateway, Wide),
    // Agent specs are gateway-wide configuration every caller may read.
    rule("GET", "/v1/agents", Read, Collection),
    rule("GET", "/v1/agents/{name}", Read, Row),
    rule("GET", "/v1/admin/users", Admin, Collection),
    rule("POST", "/v1/admin/users", Admin, Create),
    rule("DELETE", "/v1/admin/users/{email}", Admin, Row),
    rule("GET", "/v1/admin/tokens", Admin, Collection),
    rule("POST", "/v1/admin/tokens", Admin, Create),
    rule("DELETE", "/v1/admin/tokens/{id}", Admin, Row),
];

/// The rule for a routed request, if the table has one.
pub fn access(method: &str, path: &str) -> Option<&'static Rule> {
    ACCESS.iter().find(|r| r.method == method && r.path == path)
}

/// The authenticated router as it is built, with the path of every route it was given, so the
/// routes can be checked against `ACCESS` (`api::route_paths`).
pub(crate) struct Routes {
    router: Router<Arc<Core>>,
    paths: Vec<&'static str>,
}

impl Routes {
    pub(crate) fn new() -> Self {
        Self {
            router: Router::new(),
            paths: Vec::new(),
        }
    }

    pub(crate) fn route(mut self, path: &'static str, method: MethodRouter<Arc<Core>>) -> Self {
        self.router = self.router.route(path, method);
        self.paths.push(path);
        self
    }

    pub(crate) fn merge(mut self, other: Routes) -> Self {
        self.router = self.router.merge(other.router);
        self.paths.extend(other.paths);
        self
    }

    pub(crate) fn into_parts(self) -> (Router<Arc<Core>>, Vec<&'static str>) {
        (self.router, self.paths)
    }
}

/// Who is asking: a user, and the most their token lets them do.
#[derive(Clone, Debug)]
pub struct Principal {
    pub user: UserRow,
    pub cap: TokenScope,
}

impl Principal {
    pub fn scope(&self) -> Scope {
        self.user.scope()
    }

    /// How far this principal sees: a member their own rows; a viewer, an operator and an
    /// admin their whole tenant (never another tenant, whatever the role).
    pub fn sight(&self) -> Sight {
        match self.user.role {
            Role::Member => Sight::own(self.scope()),
            Role::Viewer | Role::Operator | Role::Admin => Sight::tenant(self.scope()),
        }
    }

    /// The highest need this principal meets: its role's, capped by its token.
    fn level(&self) -> Need {
        let role = match self.user.role {
            Role::Viewer => Read,
            Role::Member => Write,
            Role::Operator => Operate,
            Role::Admin if self.user.tenant_id == DEFAULT_TENANT => Gateway,
            Role::Admin => Admin,
        };
        let cap = match self.cap {
            TokenScope::Read => Read,
            TokenScope::Write => Operate,
            TokenScope::Admin => Gateway,
        };
        role.min(cap)
    }

    /// Whether the token lets the user do all their role may: the Control UI's cookie carries
    /// only the user, so only such a token may sign in to it.
    pub fn full_reach(&self) -> bool {
        let whole = Principal {
            user: self.user.clone(),
            cap: TokenScope::Admin,
        };
        whole.level() <= self.level()
    }

    pub fn may(&self, need: Need) -> bool {
        need <= self.level()
    }

    /// The gateway's admins see users and tokens of every tenant (they make the tenants);
    /// another admin only their own tenant's.
    fn tenant_filter(&self) -> Option<&str> {
        if self.may(Gateway) {
            None
        } else {
            Some(&self.user.tenant_id)
        }
    }

    /// Why a need is refused, and what to do about it.
    pub(crate) fn refusal(&self, need: Need) -> String {
        let role = self.user.role;
        let by_role = match role {
            Role::Viewer => Read,
            Role::Member => Write,
            Role::Operator => Operate,
            Role::Admin if self.user.tenant_id == DEFAULT_TENANT => Gateway,
            Role::Admin => Admin,
        };
        if need > by_role {
            let wanted = match need {
                Read | Write => "the member role",
                Operate => "the operator role",
                Admin => "the admin role",
                Gateway => "an admin of the gateway's first tenant",
            };
            format!(
                "your role ({role}) cannot {}: that needs {wanted}; ask an admin of your tenant",
                need.action()
            )
        } else {
            format!(
                "this token's scope is {}: it cannot {}; ask an admin for a token with a wider --scope",
                self.cap,
                need.action()
            )
        }
    }
}

/// The first admin as a principal: the `gateway.json` token's user.
fn first_admin(core: &Core) -> Result<UserRow, Error> {
    core.store
        .user_of(&crate::auth::admin_scope())?
        .ok_or_else(|| Error::Internal(format!("the first admin ({FIRST_ADMIN}) is missing")))
}

/// The principal behind a verified token's row.
pub(crate) fn principal_of_token(core: &Core, row: &TokenRow) -> Result<Option<Principal>, Error> {
    let user = if row.scope == crate::auth::admin_scope() {
        Some(first_admin(core)?)
    } else {
        core.store.user_of(&row.scope)?
    };
    Ok(user.map(|user| Principal { user, cap: row.cap }))
}

/// The principal behind a Control UI cookie's scope: its user with their role's full reach.
pub(crate) fn principal_of_scope(core: &Core, scope: &Scope) -> Result<Option<Principal>, Error> {
    Ok(core.store.user_of(scope)?.map(|user| Principal {
        user,
        cap: TokenScope::Admin,
    }))
}

/// Whether a scope is an admin of the gateway's first tenant (a handler's own check, behind
/// the gate's).
pub(crate) fn gateway_admin(core: &Core, scope: &Scope) -> bool {
    scope.tenant_id == DEFAULT_TENANT
        && matches!(core.store.user_of(scope), Ok(Some(u)) if u.role == Role::Admin)
}

/// The message for an expired token.
pub(crate) fn expired_message(row: &TokenRow) -> String {
    let day = row
        .expires_at_ms
        .map(crate::budgets::utc_day)
        .unwrap_or_default();
    if row.label.starts_with(crate::sso::device::SSO_LABEL) {
        return format!(
            "your sign-in (token {}) expired on {day}: sign in again with `skiff login --gateway URL`",
            row.id
        );
    }
    format!(
        "token {} expired on {day}: ask an admin for a new one (`skiff admin token create --user EMAIL --scope {} --expires 30d`)",
        row.id, row.cap
    )
}

tokio::task_local! {
    /// The acting user's email while a request is handled: what its audit rows name.
    pub(crate) static ACTOR: String;
}

/// The audit actor for the current request, or `api` outside one (a run's own work).
pub(crate) fn actor() -> String {
    ACTOR
        .try_with(|a| a.clone())
        .unwrap_or_else(|_| "api".to_owned())
}

/// Refuses what the route's rule says the principal cannot do; a route without a rule is
/// refused to everyone.
pub(crate) async fn gate(State(core): State<Arc<Core>>, req: Request, next: Next) -> Response {
    let Some(principal) = req.extensions().get::<Principal>().cloned() else {
        return Error::Internal("a request reached the gate unauthenticated".into())
            .into_response();
    };
    let path = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
        .unwrap_or_default();
    let method = req.method().as_str().to_owned();
    // HEAD is answered as GET.
    let lookup = if req.method() == Method::HEAD {
        "GET"
    } else {
        method.as_str()
    };
    let scope = principal.scope();
    let Some(rule) = access(lookup, &path) else {
        return without_rule(req, next, &method, &path).await;
    };
    let email = principal.user.email.clone();
    let mut req = req;
    let refused = if !principal.may(rule.need) {
        Some(principal.refusal(rule.need))
    } else if rule.kind == Row {
        match act_as_owner(&core, &principal, rule, &path, &mut req) {
            Ok(refusal) => refusal,
            Err(e) => return e.into_response(),
        }
    } else {
        None
    };
    if let Some(message) = refused {
        ACTOR.sync_scope(email, || {
            core.audit(
                &scope,
                "access",
                &path,
                "denied",
                json!({ "method": method, "role": principal.user.role, "scope": principal.cap }),
            )
        });
        return Error::Forbidden(message).into_response();
    }
    ACTOR.scope(email, next.run(req)).await
}

/// The kind of row a route's path names by id (its third segment), if it names one.
fn owned_row(path: &str) -> Option<Owned> {
    let kind = match path.split('/').nth(2)? {
        "sessions" => Owned::Session,
        "environments" => Owned::Environment,
        "snapshots" => Owned::Snapshot,
        "groups" => Owned::Group,
        "approvals" => Owned::Approval,
        _ => return None,
    };
    (path.split('/').nth(3) == Some("{id}")).then_some(kind)
}

/// For a route naming a row: when the row is another user's within the caller's sight, hands
/// the handler its owner's `Scope` if the rule lets the caller act on it, or says why not.
fn act_as_owner(
    core: &Core,
    principal: &Principal,
    rule: &Rule,
    path: &str,
    req: &mut Request,
) -> Result<Option<String>, Error> {
    let Some(kind) = owned_row(path) else {
        return Ok(None);
    };
    let Some(id) = req.uri().path().split('/').nth(3).map(str::to_owned) else {
        return Ok(None);
    };
    let Some(owner) = core.store.owner_of(&principal.sight(), kind, &id)? else {
        // Not seen: the handler reads under the caller's own scope and says "not found".
        return Ok(None);
    };
    if owner == principal.scope() {
        return Ok(None);
    }
    let allowed = rule.others.is_some_and(|need| principal.may(need));
    if !allowed {
        let whose = core
            .store
            .user_of(&owner)?
            .map(|u| u.email)
            .unwrap_or_else(|| "another user".to_owned());
        let noun = kind.noun();
        return Ok(Some(match rule.others {
            None => {
                format!("{noun} {id} is {whose}'s: only its owner can change it (you may read it)")
            }
            Some(_) => format!(
                "{noun} {id} is {whose}'s: changing another user's {noun} needs the operator role; ask an admin of your tenant"
            ),
        }));
    }
    req.extensions_mut().insert(owner);
    Ok(None)
}

/// A request the table has no rule for. The gate runs for every method of a matched path,
/// including ones the path does not serve: asked under a method no route has, the router says
/// which methods it serves (a 405 with `Allow`) and no handler runs. A method it does not serve
/// gets that 405; one it serves without a rule is refused to everyone.
async fn without_rule(mut req: Request, next: Next, method: &str, path: &str) -> Response {
    let Ok(probe) = Method::from_bytes(b"SKIFF-NO-RULE") else {
        return Error::Internal("cannot build the probe method".into()).into_response();
    };
    *req.method_mut() = probe;
    let resp = next.run(req).await;
    let served = resp.status() != StatusCode::METHOD_NOT_ALLOWED
        || resp
            .headers()
            .get(axum::http::header::ALLOW)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|allow| allow.split(',').any(|m| m.trim() == method));
    if served {
        tracing::error!(method, path, "a route has no rule in people::ACCESS");
        return Error::Forbidden(format!(
            "{method} {path} has no access rule; this is a gateway bug, please report it"
        ))
        .into_response();
    }
    resp
}

pub(crate) fn routes() -> Routes {
    Routes::new()
        .route("/v1/me", get(me))
        .route("/v1/admin/users", get(list_users).post(add_user))
        .route("/v1/admin/users/{email}", delete(remove_user))
        .route("/v1/admin/tokens", get(list_tokens).post(create_token))
        .route("/v1/admin/tokens/{id}", delete(revoke_token))
}

fn user_view(u: &UserRow) -> UserView {
    UserView {
        id: u.id.clone(),
        email: u.email.clone(),
        role: u.role,
        tenant: u.tenant_id.clone(),
        created_at_ms: u.created_at_ms,
    }
}

async fn me(Extension(p): Extension<Principal>) -> Response {
    let can = [Read, Write, Operate, Admin, Gateway]
        .into_iter()
        .filter(|n| p.may(*n))
        .map(|n| n.as_str().to_owned())
        .collect();
    Json(Me {
        email: p.user.email.clone(),
        role: p.user.role,
        tenant: p.user.tenant_id.clone(),
        scope: p.cap,
        can,
    })
    .into_response()
}

async fn list_users(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
) -> crate::Result<Response> {
    let users = core.store.users(p.tenant_filter())?;
    Ok(Json(UserList {
        users: users.iter().map(user_view).collect(),
    })
    .into_response())
}

/// An email as `user add` takes it: one `@` with something on both sides, no spaces.
fn check_email(email: &str) -> crate::Result<()> {
    let ok = email.len() <= 254
        && !email.chars().any(|c| c.is_whitespace() || c.is_control())
        && email
            .split_once('@')
            .is_some_and(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains('@'));
    if ok {
        Ok(())
    } else {
        Err(Error::BadRequest(format!(
            "{email:?} is not an email address (like ada@example.com)"
        )))
    }
}

/// A tenant name: letters, digits, `_`, `-` and `.`.
fn check_tenant(tenant: &str) -> crate::Result<()> {
    let ok = !tenant.is_empty()
        && tenant.len() <= 64
        && tenant
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::BadRequest(format!(
            "{tenant:?} is not a tenant name: use letters, digits, `_`, `-` and `.`"
        )))
    }
}

async fn add_user(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
    body: Result<Json<AddUserRequest>, axum::extract::rejection::JsonRejection>,
) -> crate::Result<Response> {
    let Json(body) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    check_email(&body.email)?;
    let tenant = body.tenant.unwrap_or_else(|| p.user.tenant_id.clone());
    check_tenant(&tenant)?;
    if tenant != p.user.tenant_id && !p.may(Gateway) {
        core.audit(
            &p.scope(),
            "user.add",
            &body.email,
            "denied",
            json!({ "tenant": tenant }),
        );
        return Err(Error::Forbidden(format!(
            "you may add users to your own tenant ({}) only; an admin of the gateway's first tenant adds users to others",
            p.user.tenant_id
        )));
    }
    let user = core.store.add_user(&body.email, body.role, &tenant)?;
    core.audit(
        &p.scope(),
        "user.add",
        &user.id,
        "applied",
        json!({ "role": user.role, "tenant": user.tenant_id }),
    );
    Ok((StatusCode::CREATED, Json(user_view(&user))).into_response())
}

async fn remove_user(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
    Path(email): Path<String>,
) -> crate::Result<Response> {
    let user = core.store.user_by_email(&email, p.tenant_filter())?;
    if user.id == FIRST_ADMIN {
        return Err(Error::Conflict(
            "the gateway's first admin cannot be removed: its token is in gateway.json".into(),
        ));
    }
    let tokens = core.store.remove_user(&user)?;
    core.audit(
        &p.scope(),
        "user.remove",
        &user.id,
        "applied",
        json!({ "tokens_revoked": tokens.len() }),
    );
    Ok(Json(user_view(&user)).into_response())
}

fn token_view(core: &Core, row: &TokenRow) -> crate::Result<TokenView> {
    let email = if row.scope == crate::auth::admin_scope() {
        first_admin(core)?.email
    } else {
        core.store
            .user_of(&row.scope)?
            .map(|u| u.email)
            .unwrap_or_else(|| "-".to_owned())
    };
    Ok(TokenView {
        id: row.id.clone(),
        email,
        tenant: row.scope.tenant_id.clone(),
        scope: row.cap,
        created_at_ms: row.created_at_ms,
        expires_at_ms: row.expires_at_ms,
    })
}

async fn list_tokens(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
) -> crate::Result<Response> {
    let tenant = p.tenant_filter().map(str::to_owned);
    let mut tokens = Vec::new();
    for row in core.store.token_rows()? {
        if tenant.as_deref().is_none_or(|t| t == row.scope.tenant_id) {
            tokens.push(token_view(&core, &row)?);
        }
    }
    Ok(Json(TokenList { tokens }).into_response())
}

async fn create_token(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
    body: Result<Json<CreateTokenRequest>, axum::extract::rejection::JsonRejection>,
) -> crate::Result<Response> {
    let Json(body) = body.map_err(|e| Error::BadRequest(e.body_text()))?;
    if body.expires_in_s == 0 || body.expires_in_s > MAX_TOKEN_LIFETIME_S {
        return Err(Error::BadRequest(format!(
            "a token must expire within a year (--expires between 1s and 366d), not {}s",
            body.expires_in_s
        )));
    }
    let user = core
        .store
        .user_by_email(&body.email, p.tenant_filter())
        .map_err(|_| {
            Error::NotFound(format!(
                "no user {} in your tenant: add them first with `skiff admin user add {} --role ROLE`",
                body.email, body.email
            ))
        })?;
    let secret = crate::auth::mint()?;
    let hash = blake3::hash(secret.as_bytes()).to_hex().to_string();
    let expires_in_ms = i64::try_from(body.expires_in_s.saturating_mul(1000)).unwrap_or(i64::MAX);
    let expires_at_ms = skiff_store::now_ms().saturating_add(expires_in_ms);
    let row = core.store.add_token(
        &user.scope(),
        &hash,
        &format!("user:{}", user.email),
        body.scope,
        Some(expires_at_ms),
    )?;
    core.audit(
        &p.scope(),
        "token.create",
        &row.id,
        "applied",
        json!({ "user": user.id, "scope": row.cap, "expires_at_ms": expires_at_ms }),
    );
    let token = token_view(&core, &row)?;
    Ok((StatusCode::CREATED, Json(CreatedToken { token, secret })).into_response())
}

async fn revoke_token(
    State(core): State<Arc<Core>>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
) -> crate::Result<Response> {
    if id == format!("tok_{}", crate::auth::ADMIN_LABEL) {
        return Err(Error::Conflict(
            "the first admin's token (in gateway.json) cannot be revoked; delete gateway.json and restart the gateway to mint a new one".into(),
        ));
    }
    let row = core.store.revoke_token(&id, p.tenant_filter())?;
    let view = token_view(&core, &row)?;
    core.audit(&p.scope(), "token.revoke", &row.id, "applied", json!({}));
    Ok(Json(view).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(role: Role, tenant: &str, cap: TokenScope) -> Principal {
        Principal {
            user: UserRow {
                id: "usr_x".into(),
                tenant_id: tenant.into(),
                email: "x@y".into(),
                role,
                created_at_ms: 0,
            },
            cap,
        }
    }

    #[test]
    fn a_token_scope_caps_the_role_and_only_first_tenant_admins_reach_the_gateway() {
        let admin_read = principal(Role::Admin, "t", TokenScope::Read);
        assert!(admin_read.may(Read));
        assert!(
            !admin_read.may(Write),
            "a read token of an admin cannot write"
        );
        let viewer = principal(Role::Viewer, "t", TokenScope::Admin);
        assert!(!viewer.may(Write));
        assert!(viewer.refusal(Write).contains("your role (viewer)"));
        assert!(admin_read.refusal(Write).contains("token's scope is read"));
        let member = principal(Role::Member, "t", TokenScope::Write);
        assert!(member.may(Write) && !member.may(Operate));
        let operator = principal(Role::Operator, "t", TokenScope::Write);
        assert!(operator.may(Operate) && !operator.may(Admin));
        let tenant_admin = principal(Role::Admin, "t", TokenScope::Admin);
        assert!(tenant_admin.may(Admin) && !tenant_admin.may(Gateway));
        let first = principal(Role::Admin, DEFAULT_TENANT, TokenScope::Admin);
        assert!(first.may(Gateway));
        let first_write = principal(Role::Admin, DEFAULT_TENANT, TokenScope::Write);
        assert!(!first_write.may(Admin), "a write token never manages users");
    }

    #[test]
    fn a_member_sees_their_own_rows_and_every_other_role_their_tenants() {
        use skiff_store::Reach;
        for (role, reach) in [
            (Role::Member, Reach::Own),
            (Role::Viewer, Reach::Tenant),
            (Role::Operator, Reach::Tenant),
            (Role::Admin, Reach::Tenant),
        ] {
            let sight = principal(role, "t", TokenScope::Admin).sight();
            assert_eq!(sight.reach, reach, "{role}");
            assert_eq!(
                sight.scope,
                Scope::new("usr_x", "t"),
                "never another tenant"
            );
        }
        // Operating another user's session needs an operator; driving it, its owner.
        let others = |m: &str, p: &str| access(m, p).and_then(|r| r.others);
        assert_eq!(others("POST", "/v1/sessions/{id}/cancel"), Some(Operate));
        assert_eq!(others("POST", "/v1/approvals/{id}/deny"), Some(Operate));
        assert_eq!(others("GET", "/v1/sessions/{id}"), Some(Read));
        assert_eq!(others("POST", "/v1/sessions/{id}/messages"), None);
        assert_eq!(others("POST", "/v1/sessions/{id}/fork"), None);
        assert_eq!(
            owned_row("/v1/sessions/{id}/runs/{run}/changes"),
            Some(Owned::Session)
        );
        assert_eq!(owned_row("/v1/snapshots/{id}"), Some(Owned::Snapshot));
        assert_eq!(owned_row("/v1/environments/sweep"), None);
        assert_eq!(owned_row("/v1/admin/tokens/{id}"), None);
    }

    #[test]
    fn an_expired_sign_in_says_to_sign_in_again_and_an_admin_token_to_ask_an_admin() {
        let row = |label: &str| TokenRow {
            id: "tok_x".into(),
            hash: String::new(),
            scope: Scope::new("usr_x", "t"),
            label: label.into(),
            cap: TokenScope::Admin,
            created_at_ms: 0,
            expires_at_ms: Some(0),
        };
        let sso = expired_message(&row("sso:ana@example.com"));
        assert!(sso.contains("skiff login --gateway"), "{sso}");
        let made = expired_message(&row("user:ana@example.com"));
        assert!(made.contains("skiff admin token create"), "{made}");
    }

    #[test]
    fn the_access_table_has_one_rule_per_route() {
        let mut seen = std::collections::HashSet::new();
        for r in ACCESS {
            assert!(
                seen.insert((r.method, r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
            if r.method != "GET" && r.kind != Kind::Own {
                assert!(
                    r.need > Read,
                    "{} {} writes but needs only read",
                    r.method,
                    r.path
                );
            }
        }
        let (_, paths) = crate::api::routes_table().into_parts();
        for path in paths {
            assert!(
                ACCESS.iter().any(|r| r.path == path),
                "route {path} has no rule in people::ACCESS"
            );
        }
    }
}
