//! The governed wrapper's grant checks on a real store: a grant runs exactly the arguments it
//! was minted for, once, within five minutes, for its own session and requester only.

use super::Plan;
use super::grant::{self, GRANT_TTL_MS, GrantKey, Proposal, Refusal};
use skiff_protocol::SessionId;
use skiff_protocol::grant::Capability;
use skiff_store::{Scope, Store};

struct Fixture {
    _dir: tempfile::TempDir,
    store: Store,
    key: GrantKey,
    scope: Scope,
    session: SessionId,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("skiff.db")).unwrap();
    Fixture {
        _dir: dir,
        store,
        key: GrantKey::from_bytes([7; 32]),
        scope: Scope::new("alice", "acme"),
        session: SessionId::from_suffix("one"),
    }
}

fn push_plan(branch: &str) -> Plan {
    Plan::GitPush {
        repository_dir: "/srv/repo".into(),
        remote: "origin".into(),
        branch: branch.into(),
    }
}

const T0: i64 = 1_700_000_000_000;

impl Fixture {
    fn mint(&self, plan: &Plan, now: i64) -> String {
        let proposal = Proposal {
            session: &self.session,
            capability: plan.capability(),
            target: "origin refs/heads/skiff/ses_one".into(),
            digest: plan.digest(),
            policy_revision: "rev1".into(),
            confirm: true,
        };
        grant::mint(&self.store, &self.key, &self.scope, proposal, now)
            .unwrap()
            .0
    }

    fn redeem(&self, token: &str, plan: &Plan, now: i64) -> Result<(), Refusal> {
        self.redeem_as(&self.scope, &self.session, token, plan, now)
    }

    fn redeem_as(
        &self,
        scope: &Scope,
        session: &SessionId,
        token: &str,
        plan: &Plan,
        now: i64,
    ) -> Result<(), Refusal> {
        grant::redeem(
            &self.store,
            &self.key,
            scope,
            session,
            plan.capability(),
            token,
            &plan.digest(),
            now,
        )
        .map(|_| ())
    }
}

#[test]
fn a_grant_runs_once_and_a_replay_is_refused() {
    let f = fixture();
    let plan = push_plan("skiff/ses_one");
    let token = f.mint(&plan, T0);
    assert_eq!(f.redeem(&token, &plan, T0 + 1_000), Ok(()));
    let again = f.redeem(&token, &plan, T0 + 2_000).unwrap_err();
    assert!(matches!(again, Refusal::Replayed { .. }), "{again:?}");
}

#[test]
fn an_expired_grant_is_refused_and_stays_unused() {
    let f = fixture();
    let plan = push_plan("skiff/ses_one");
    let token = f.mint(&plan, T0);
    let late = f.redeem(&token, &plan, T0 + GRANT_TTL_MS).unwrap_err();
    assert!(matches!(late, Refusal::Expired { .. }), "{late:?}");
    // Just inside the five minutes it still runs: the expiry refusal consumed nothing.
    assert_eq!(f.redeem(&token, &plan, T0 + GRANT_TTL_MS - 1), Ok(()));
}

#[test]
fn a_forged_or_altered_grant_is_refused() {
    let f = fixture();
    let plan = push_plan("skiff/ses_one");
    let token = f.mint(&plan, T0);
    // Signed with another key.
    let other = GrantKey::from_bytes([8; 32]);
    let proposal = Proposal {
        session: &f.session,
        capability: Capability::GitPush,
        target: "origin refs/heads/skiff/ses_one".into(),
        digest: plan.digest(),
        policy_revision: "rev1".into(),
        confirm: false,
    };
    let forged = grant::mint(&f.store, &other, &f.scope, proposal, T0)
        .unwrap()
        .0;
    assert_eq!(f.redeem(&forged, &plan, T0), Err(Refusal::Forged));
    // Claims edited after signing (no confirmation), the old signature kept.
    let mut parts: Vec<&str> = token.split('.').collect();
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let json = String::from_utf8(b64.decode(parts[1]).unwrap()).unwrap();
    let edited = b64.encode(json.replace("\"confirm\":true", "\"confirm\":false"));
    parts[1] = &edited;
    assert_eq!(f.redeem(&parts.join("."), &plan, T0), Err(Refusal::Forged));
    assert_eq!(f.redeem("grant1.bm90.aGk", &plan, T0), Err(Refusal::Forged));
    assert_eq!(f.redeem("not a grant", &plan, T0), Err(Refusal::Malformed));
    // The genuine one was never touched by those attempts.
    assert_eq!(f.redeem(&token, &plan, T0), Ok(()));
}

#[test]
fn a_grant_with_other_arguments_is_refused() {
    let f = fixture();
    let token = f.mint(&push_plan("skiff/ses_one"), T0);
    let other = push_plan("main");
    let refused = f.redeem(&token, &other, T0).unwrap_err();
    assert!(
        matches!(refused, Refusal::DigestMismatch { .. }),
        "{refused:?}"
    );
    // A pull request's plan under a push grant: refused before anything is consumed.
    let token = f.mint(&push_plan("skiff/ses_one"), T0);
    let pr = Plan::OpenPullRequest {
        repository: "acme/widgets".into(),
        title: "t".into(),
        body: "b".into(),
        head: "skiff/ses_one".into(),
        base: "main".into(),
    };
    let refused = f.redeem(&token, &pr, T0).unwrap_err();
    assert!(
        matches!(refused, Refusal::WrongCapability { .. }),
        "{refused:?}"
    );
}

#[test]
fn another_sessions_or_tenants_grant_is_refused() {
    let f = fixture();
    let plan = push_plan("skiff/ses_one");
    let token = f.mint(&plan, T0);
    let other_session = SessionId::from_suffix("two");
    let refused = f
        .redeem_as(&f.scope, &other_session, &token, &plan, T0)
        .unwrap_err();
    assert!(matches!(refused, Refusal::Foreign { .. }), "{refused:?}");
    let other_tenant = Scope::new("alice", "globex");
    let refused = f
        .redeem_as(&other_tenant, &f.session, &token, &plan, T0)
        .unwrap_err();
    assert!(matches!(refused, Refusal::Foreign { .. }), "{refused:?}");
    let other_user = Scope::new("bob", "acme");
    let refused = f
        .redeem_as(&other_user, &f.session, &token, &plan, T0)
        .unwrap_err();
    assert!(matches!(refused, Refusal::Foreign { .. }), "{refused:?}");
    // A validly signed grant that was never registered (minted by no one here).
    let unregistered = f.key.sign(&skiff_protocol::grant::GrantClaims {
        id: skiff_protocol::GrantId::from_suffix("ghost"),
        requester: "alice".into(),
        tenant: "acme".into(),
        session: f.session.clone(),
        capability: Capability::GitPush,
        target: "origin refs/heads/skiff/ses_one".into(),
        digest: plan.digest(),
        policy_revision: "rev1".into(),
        confirm: false,
        issued_at_ms: T0,
        expires_at_ms: T0 + GRANT_TTL_MS,
    });
    let refused = f.redeem(&unregistered, &plan, T0).unwrap_err();
    assert!(matches!(refused, Refusal::Foreign { .. }), "{refused:?}");
    // The owner's own redemption still works.
    assert_eq!(f.redeem(&token, &plan, T0), Ok(()));
}

#[test]
fn the_grant_key_file_is_private_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let a = GrantKey::load_or_create(dir.path(), None).unwrap();
    let path = dir.path().join("grant.key");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let b = GrantKey::load_or_create(dir.path(), None).unwrap();
    let claims = skiff_protocol::grant::GrantClaims {
        id: skiff_protocol::GrantId::from_suffix("k"),
        requester: "a".into(),
        tenant: "t".into(),
        session: SessionId::from_suffix("s"),
        capability: Capability::GitPush,
        target: "x".into(),
        digest: "d".into(),
        policy_revision: "r".into(),
        confirm: true,
        issued_at_ms: T0,
        expires_at_ms: T0 + 1,
    };
    assert_eq!(b.verify(&a.sign(&claims), T0), Ok(claims));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = GrantKey::load_or_create(dir.path(), None).err().unwrap();
    assert!(err.to_string().contains("chmod 600"), "{err}");
    let err = GrantKey::load_or_create(dir.path(), Some("x".into()))
        .err()
        .unwrap();
    assert!(err.to_string().contains("SKIFF_GRANT_KEY"), "{err}");
}

#[test]
fn the_mac_is_hmac_sha256() {
    // RFC 4231, test case 2 (a key shorter than the block is zero-padded, as ours is).
    let mut key = [0u8; 32];
    key[..4].copy_from_slice(b"Jefe");
    let mac = GrantKey::from_bytes(key).mac_for_test(b"what do ya want for nothing?");
    let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
}

/// The wrapper as the gateway runs it: each refusal is the tool's error and an audit row
/// naming why, with the grant's id and never its token.
#[tokio::test]
async fn the_gateways_wrapper_refuses_and_audits_bad_grants() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("skiff.toml");
    std::fs::write(
        &config_path,
        "[forge]\napi = \"http://127.0.0.1:9\"\ntoken = \"env:SKIFF_TEST_UNSET_FORGE_TOKEN\"\nrepository = \"acme/widgets\"\n",
    )
    .unwrap();
    let (core, _, _) = crate::open_core(&crate::Options {
        state_dir: dir.path().join("state"),
        listen: "127.0.0.1:0".into(),
        config: Some(config_path),
    })
    .await
    .unwrap();
    let scope = Scope::new("usr_test", "ten_test");
    let session = SessionId::from_suffix("wrapped");
    let plan = push_plan("skiff/ses_wrapped");
    let cancel = tokio_util::sync::CancellationToken::new();
    let mint = |plan: &Plan| {
        let proposal = Proposal {
            session: &session,
            capability: plan.capability(),
            target: "origin refs/heads/skiff/ses_wrapped".into(),
            digest: plan.digest(),
            policy_revision: "rev1".into(),
            confirm: false,
        };
        grant::mint(
            &*core.store,
            &core.governed.key,
            &scope,
            proposal,
            core.governed.now(),
        )
        .unwrap()
        .0
    };
    let run = |token: String, plan: Plan| {
        let core = core.clone();
        let scope = scope.clone();
        let session = session.clone();
        let cancel = cancel.clone();
        async move {
            core.governed_execute(&scope, &session, &token, &plan, &cancel)
                .await
        }
    };

    // Forged: signed by another key.
    let forged = GrantKey::from_bytes([9; 32]).sign(&skiff_protocol::grant::GrantClaims {
        id: skiff_protocol::GrantId::from_suffix("forged"),
        requester: "usr_test".into(),
        tenant: "ten_test".into(),
        session: session.clone(),
        capability: Capability::GitPush,
        target: "x".into(),
        digest: plan.digest(),
        policy_revision: "rev1".into(),
        confirm: false,
        issued_at_ms: core.governed.now(),
        expires_at_ms: core.governed.now() + GRANT_TTL_MS,
    });
    let out = run(forged.clone(), plan.clone()).await;
    assert!(
        out.is_error && out.content.contains("forged"),
        "{}",
        out.content
    );

    // Digest mismatch: minted for one branch, asked to run another.
    let token = mint(&plan);
    let out = run(token, push_plan("main")).await;
    assert!(
        out.is_error && out.content.contains("not the ones grant"),
        "{}",
        out.content
    );

    // Replayed: the first redemption runs (and fails on the missing token), the second is
    // refused before anything runs.
    let token = mint(&plan);
    let first = run(token.clone(), plan.clone()).await;
    assert!(
        first.content.contains("SKIFF_TEST_UNSET_FORGE_TOKEN"),
        "{}",
        first.content
    );
    let out = run(token.clone(), plan.clone()).await;
    assert!(
        out.is_error && out.content.contains("already used"),
        "{}",
        out.content
    );

    // Expired: the clock moved past five minutes.
    let token = mint(&plan);
    core.governed
        .skew_ms
        .store(GRANT_TTL_MS + 1_000, std::sync::atomic::Ordering::Relaxed);
    let out = run(token.clone(), plan.clone()).await;
    assert!(
        out.is_error && out.content.contains("expired"),
        "{}",
        out.content
    );

    let rows = core.store.audit_rows().unwrap();
    let reasons: Vec<&str> = rows
        .iter()
        .filter(|r| r.action == "governed.refused")
        .map(|r| r.detail["reason"].as_str().unwrap())
        .collect();
    assert_eq!(
        reasons,
        ["forged", "digest_mismatch", "replayed", "expired"]
    );
    assert!(
        rows.iter()
            .all(|r| !r.detail.to_string().contains(&token) && !r.target.contains(&forged)),
        "an audit row carries a grant token"
    );
}
