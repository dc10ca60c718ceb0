//! The control plane. It owns auth, routing and policy: the API, the event fan-out, session
//! workspaces, the execution of runs with the agent loop in this process (placement `local`),
//! and, hanging off [`Core`], environments, worker placement, sync, checkpoints and the
//! egress proxy.
//!
//! Deliberately absent: SQL (that is `skiff-store`), provider wire formats and keys
//! (`skiff-llm`), and the loop itself (`skiff-agent`).

mod agents;
mod api;
mod approvals;
pub mod audit_trail;
mod auth;
mod backend;
mod budgets;
pub mod bundle;
mod checkpoints;
mod chores;
mod cluster;
mod compaction;
pub mod config;
mod control;
mod dispatch;
mod drain;
mod egress;
mod env_api;
mod environments;
mod error;
mod forward;
mod governed;
mod groups;
mod housekeeping;
mod hub;
mod ingress;
mod mcp;
mod metrics;
mod ownership;
mod people;
mod placement;
mod quarantine;
mod remote;
mod restore;
mod results;
mod sessions;
mod sso;
pub mod state_dir;
mod sync_api;
mod telemetry;
mod traces;
mod transcript;
mod ui;
mod vault;
mod web_fetch;
mod worker;
mod workspace;

pub use api::route_paths;
pub use error::{Error, Result};
pub use hub::Hub;
pub use people::{ACCESS, Kind, Need, Rule, access};

use config::Config;
use serde::{Deserialize, Serialize};
use skiff_protocol::RunId;
use skiff_protocol::api::RunStatus;
use skiff_protocol::event::EventKind;
use state_dir::StateDir;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// The store `[store] url` names (PostgreSQL), or the state dir's embedded SQLite database.
/// A PostgreSQL store that cannot be opened — a malformed url, a server that does not
/// answer, a database a newer Skiff migrated — is a configuration error naming the key, and
/// never the password.
fn open_store(
    config_path: &std::path::Path,
    postgres: Option<&config::Postgres>,
    state: &StateDir,
) -> Result<Arc<dyn skiff_store::Backend>> {
    let Some(pg) = postgres else {
        return Ok(skiff_store::open_backend(skiff_store::Location::Sqlite(
            &state.database(),
        ))?);
    };
    let opened = skiff_store::open_backend(skiff_store::Location::Postgres {
        url: &pg.url,
        password: pg.password.as_deref(),
    });
    match opened {
        Ok(store) => {
            tracing::info!("the store is PostgreSQL (`[store] url`)");
            Ok(store)
        }
        Err(e) => {
            let mut message = format!("at `store.url`: {e}");
            // The store's messages leave the password out; this makes sure of it.
            for secret in pg
                .password
                .iter()
                .map(String::as_str)
                .chain(url_password(&pg.url))
            {
                if !secret.is_empty() {
                    message = message.replace(secret, "***");
                }
            }
            Err(Error::Config(config::ConfigError::Invalid {
                path: config_path.display().to_string(),
                message,
            }))
        }
    }
}

/// The password written into a `postgres://USER:PASSWORD@HOST/…` url, or a connection
/// string's `password=…`, as written (for scrubbing it from messages).
fn url_password(url: &str) -> Option<&str> {
    if let Some(rest) = url
        .strip_prefix("postgres://")
        .or_else(|| url.strip_prefix("postgresql://"))
    {
        let userinfo = &rest[..rest.rfind('@')?];
        return userinfo.split_once(':').map(|(_, password)| password);
    }
    let at = url.find("password=")? + "password=".len();
    let value = url[at..].trim_start_matches('\'');
    Some(value.split(['\'', ' ']).next().unwrap_or(value))
}

/// What `skiff gateway` is started with.
#[derive(Clone, Debug)]
pub struct Options {
    pub state_dir: PathBuf,
    pub listen: String,
    /// `<state-dir>/skiff.toml` when absent.
    pub config: Option<PathBuf>,
}

/// `<state-dir>/gateway.json`: how a local CLI finds and authenticates to the gateway.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct GatewayFile {
    pub url: String,
    /// The deployment's admin token; absent when this gateway joined a shared database whose
    /// admin token another gateway minted ([`JOINED_WITHOUT_TOKEN`] says what to do).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// What a gateway that joined a shared database without its admin token, and a CLI that finds
/// no token in `gateway.json`, tell the operator.
pub const JOINED_WITHOUT_TOKEN: &str = "this database's admin token was minted by the first \
    gateway started on it, and a gateway joining it never mints or replaces it: copy the first \
    gateway's gateway.json into this state dir and restart this gateway (the URL is rewritten \
    at start; the shared token also lets every gateway accept the same Control UI sign-ins), or \
    create a token with `skiff admin token create --user EMAIL --scope admin` through a gateway \
    you can use and set SKIFF_URL and SKIFF_TOKEN";

/// Everything the API handlers and run tasks share.
pub(crate) struct Core {
    store: Arc<dyn skiff_store::Backend>,
    hub: Arc<Hub>,
    catalog: skiff_llm::Catalog,
    state: StateDir,
    tokens: auth::Tokens,
    /// Whether the database is `[store] url`'s, which other gateways may share: then the
    /// admin token is minted once per database, never replaced by a starting gateway.
    shared_database: bool,
    running: Mutex<HashMap<RunId, CancellationToken>>,
    /// The Control UI's login tickets and cookie key.
    ui: ui::UiState,
    envs: Arc<environments::Environments>,
    /// The worker side of placement: dispatch, turns on workers, pull-back, handoff,
    /// recovery and failover, reaching the core only through the handles it lends.
    workers: Arc<worker::WorkerSide>,
    /// This process's hold on the state dir (one gateway per state dir), shared with the
    /// worker side and let go when the last handle on either is dropped.
    _lock: Arc<Hold>,
    /// `<state>/procs/`: the `exec` commands of gateway-placed sessions now running.
    procs: skiff_process::Ledger,
    /// `[gateway] turn_timeout`: how long a turn may run unless its profile says otherwise.
    turn_timeout: std::time::Duration,
    /// `[gateway] compact_at`: the share of a model's window past which a context compacts.
    compact_at: f64,
    /// `[gateway] max_children`: how many child sessions one session's agent may dispatch.
    max_children: u64,
    /// Sessions whose worktree is still being filled: everything that touches the workspace
    /// waits for it (`workspace.rs`).
    fills: Arc<workspace::Fills>,
    /// Sessions whose workspace is being restored to a checkpoint: no turn is admitted.
    restoring: Mutex<std::collections::HashSet<skiff_protocol::SessionId>>,
    /// `[git.credentials]`: the gateway's own credentials for remote repositories.
    git_credentials: remote::Credentials,
    /// Sealed secrets (`vault:NAME` in configuration); the catalog holds it too.
    vault: Arc<vault::Vault>,
    /// The background processes of gateway-placed sessions, one registry per session across
    /// its turns, so `process {keep: true}` lives on between turns. Dropping a registry stops
    /// what it holds: when the session leaves the gateway, and when the gateway stops.
    session_processes: worker::SessionProcesses,
    /// `[mcp.NAME]`: the MCP servers started at startup and the tools they offer.
    mcp: mcp::Mcp,
    /// `[forge]`: governed actions (`git_push`, `open_pull_request`) and their grant key.
    governed: governed::Governed,
    /// What `GET /metrics` reports beyond the store's gauges; the hub holds it too.
    telemetry: Arc<telemetry::Telemetry>,
    /// `[gateway] approval` and `approval_timeout`, and the tool calls waiting for a person.
    approvals: Arc<approvals::Approvals>,
    /// `[budgets]` and each profile's overrides, checked before every model call.
    budgets: budgets::Budgets,
    /// The id of the newest audit row, for `audit tail --follow`.
    audit_feed: tokio::sync::watch::Sender<i64>,
    /// `[audit] retention`.
    audit_retention: std::time::Duration,
    /// `[gateway] local_sandbox`: whether gateway-placed sessions' commands run sandboxed.
    local_sandbox: bool,
    /// `[gateway] local_sandbox_paths`: host directories their sandbox shows read-write.
    local_sandbox_paths: Vec<PathBuf>,
    /// What the operator is told at start about the sandbox, when it is off or cannot be made.
    sandbox_warning: Option<String>,
    /// Where agent specs are configured; their versions are in the store.
    agents: agents::Agents,
    /// `[ingress.slack]`, when configured (otherwise its route does not exist).
    slack: Option<Arc<ingress::Slack>>,
    /// `[auth.proxy]`, when configured: every request is authenticated by the proxy's
    /// assertion and nothing else.
    proxy: Option<sso::proxy::Proxy>,
    /// `[auth.oidc]`, when configured: the Control UI's and `skiff login`'s single sign-on.
    oidc: Option<Arc<sso::oidc::Oidc>>,
    /// This gateway's id, registry row and heartbeat among the gateways on its database.
    cluster: Arc<cluster::Cluster>,
    /// Runs taken over from a gateway that died, with the attempt their next one follows.
    resumes: Mutex<HashMap<RunId, skiff_protocol::AttemptId>>,
    /// Cancelled when `skiff gateway drain` is done: the process is to exit.
    drained: CancellationToken,
}

/// The state dir's lock and the signal that it was let go. Fields drop in order: the lock
/// is released before the sender goes, so whoever the sender's end wakes can take it at once.
struct Hold {
    _lock: state_dir::StateDirLock,
    _released: tokio::sync::oneshot::Sender<()>,
}

/// How long [`Running::shutdown`] waits for background work to let go of the state dir
/// before it leaves the lock to the end of the process.
const RELEASE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A started gateway.
pub struct Running {
    pub url: String,
    /// The admin token in `gateway.json`; `None` when this gateway joined a shared database
    /// without it.
    pub token: Option<String>,
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    core: Arc<Core>,
    /// Resolves once the core, and with it the state dir's lock, is gone.
    released: tokio::sync::oneshot::Receiver<()>,
}

impl Running {
    /// Stops accepting requests and worker connections, cancels running turns, and waits
    /// until every task that used the gateway has let go of it, so that the state dir is
    /// free for the next gateway when this returns (in this process too).
    pub async fn shutdown(self) {
        let Running {
            shutdown,
            server,
            core,
            released,
            ..
        } = self;
        shutdown.cancel();
        let tokens: Vec<_> = core
            .running
            .lock()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default();
        for token in tokens {
            token.cancel();
        }
        // After the cancels: a worker's connection still carries its turn's cancel out.
        core.workers.stop();
        let _ = server.await;
        core.mcp.shutdown().await;
        drop(core);
        // The cancelled turns, a worker connection's last frames, the audit archiver: each
        // ends soon and drops its handle, and the last one releases the lock.
        if tokio::time::timeout(RELEASE_GRACE, released).await.is_err() {
            tracing::warn!(
                "background work still holds the state dir after {} s; it is released when this process exits",
                RELEASE_GRACE.as_secs()
            );
        }
    }

    /// A warning for the operator about the tools of gateway-placed sessions: that
    /// `[gateway] local_sandbox` is off, or that this host cannot sandbox them (their commands
    /// are then refused).
    pub fn sandbox_warning(&self) -> Option<&str> {
        self.core.sandbox_warning.as_deref()
    }

    /// Resolves once `skiff gateway drain` handed this gateway's sessions over: the caller
    /// then shuts it down and exits.
    pub fn drained(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.core.drained.clone().cancelled_owned()
    }

    /// Waits until the server stops (it stops on its own only on an I/O error).
    pub async fn wait(&mut self) -> std::io::Result<()> {
        (&mut self.server).await.unwrap_or(Ok(()))
    }
}

/// Opens the state dir and database, reconciles what a previous process left, binds the
/// listener and starts serving.
pub async fn start(options: Options) -> Result<Running> {
    let (core, lifetime_tick, released) = open_core(&options).await?;
    spawn_lifetime_enforcer(&core, lifetime_tick);
    audit_trail::spawn_archiver(&core);

    let listener = tokio::net::TcpListener::bind(&options.listen)
        .await
        .map_err(|source| Error::Listen {
            addr: options.listen.clone(),
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| Error::Listen {
        addr: options.listen.clone(),
        source,
    })?;
    let url = format!("http://{addr}");
    core.cluster.advertise(&addr.to_string())?;
    let token = core.admin_token(&url)?;
    if let Some(token) = &token {
        core.ui.set_key(token);
    }

    let shutdown = CancellationToken::new();
    let app = api::router(core.clone());
    let stop = shutdown.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await
    });
    tracing::info!(%url, state_dir = %core.state.root().display(), gateway = %core.cluster.id(),
        lease_ttl = ?core.cluster.lease_ttl(), "gateway listening");
    Ok(Running {
        url,
        token,
        addr,
        shutdown,
        server,
        core,
        released,
    })
}

/// Opens the state dir, config, store and catalog, and reconciles what a previous process
/// left, up to the point where the API could listen. Tests drive the returned core directly
/// (an in-process gateway: no listener, no spawned binary). The receiver resolves once the
/// core is dropped and its state dir lock released.
pub(crate) async fn open_core(
    options: &Options,
) -> Result<(
    Arc<Core>,
    std::time::Duration,
    tokio::sync::oneshot::Receiver<()>,
)> {
    let mut state = StateDir::open(&options.state_dir)?;
    let (released_tx, released) = tokio::sync::oneshot::channel();
    let lock = Arc::new(Hold {
        _lock: state.lock()?,
        _released: released_tx,
    });
    let procs = kill_leftover_processes(&state)?;
    let config_path = options
        .config
        .clone()
        .unwrap_or_else(|| state.root().join("skiff.toml"));
    let config = Config::load(&config_path)?;
    if let Some(workspaces) = &config.store.workspaces {
        state.set_workspaces(workspaces)?;
    }
    let git_credentials = remote::Credentials::from_config(&config_path, &config.git)?;
    let lifetime_tick = config.gateway.lifetime_tick(&config_path)?;
    let credential_ttl = config.gateway.worker_credential_ttl(&config_path)?;
    let turn_timeout = config.gateway.turn_timeout(&config_path)?;
    let mcp_servers = mcp::validate(&config_path, &config.mcp)?;
    let forge = governed::validate(&config_path, config.forge.as_ref())?;
    let compact_at = config.gateway.compact_at(&config_path)?;
    let approval_timeout = config.gateway.approval_timeout(&config_path)?;
    check_approval_policies(&config_path, &config)?;
    let budgets = budgets::Budgets::from_config(&config_path, &config.budgets, &config.profiles)?;
    let audit_retention = config.audit.retention(&config_path)?;
    let postgres = config.store.postgres(&config_path)?;
    let barrier_fault = config.gateway.barrier_fault(&config_path)?;
    let local_sandbox = config.gateway.local_sandbox(&config_path)?;
    let local_sandbox_paths = config
        .gateway
        .local_sandbox_paths(&config_path, state.root())?;
    // Other sessions' workspaces are as much the sandbox's to hide as the state dir.
    if state.workspaces_root() != state.root() {
        config
            .gateway
            .local_sandbox_paths(&config_path, state.workspaces_root())?;
    }
    let sandbox_warning = sandbox_warning(local_sandbox).await;
    let slack_config = ingress::validate(&config.ingress).map_err(|message| {
        Error::Config(config::ConfigError::Invalid {
            path: config_path.display().to_string(),
            message,
        })
    })?;
    if config.auth.proxy.is_some() && config.auth.oidc.is_some() {
        return Err(Error::Config(config::ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: "at `auth`: `[auth.proxy]` and `[auth.oidc]` are both set; behind an identity-aware proxy its assertion alone signs people in, so remove one".into(),
        }));
    }
    let proxy = match &config.auth.proxy {
        Some(proxy) => Some(
            sso::proxy::Proxy::from_config(&config_path, proxy)
                .await
                .map_err(|message| {
                    Error::Config(config::ConfigError::Invalid {
                        path: config_path.display().to_string(),
                        message,
                    })
                })?,
        ),
        None => None,
    };
    let config_dir = config_path.parent().map(PathBuf::from).unwrap_or_default();
    let store = open_store(&config_path, postgres.as_ref(), &state)?;
    let lease_ttl = config.gateway.lease_ttl(&config_path)?;
    let cluster = Arc::new(cluster::Cluster::join(store.clone(), &state, lease_ttl)?);
    let (audit_feed, _) = tokio::sync::watch::channel(0i64);
    let feed = audit_feed.clone();
    store.on_audit(Box::new(move |id| {
        feed.send_replace(id);
    }));
    // Read once: the variable is this process's, and no child inherits it (`skiff-process`).
    let vault = Arc::new(vault::Vault::new(
        store.clone(),
        state.root(),
        std::env::var(vault::KEY_ENV).ok(),
    ));
    // Before anything opens or seals a secret: on a shared database every gateway must hold
    // the key that sealed what is there (never a key of its own beside it).
    if postgres.is_some() {
        vault.check_shared_database()?;
    }
    let oidc = match &config.auth.oidc {
        Some(oidc) => Some(Arc::new(
            sso::oidc::Oidc::from_config(oidc, vault.clone())
                .await
                .map_err(|message| {
                    Error::Config(config::ConfigError::Invalid {
                        path: config_path.display().to_string(),
                        message,
                    })
                })?,
        )),
        None => None,
    };
    let catalog = skiff_llm::Catalog::new(
        config.providers,
        config.models.default,
        &config_dir,
        Some(vault.clone() as Arc<dyn skiff_llm::Secrets>),
    )?;
    let tokens = auth::Tokens::new(store.clone());
    // Read once, like the vault key: no child inherits it. Without `[forge]` nothing is ever
    // minted, and no key file is made.
    let grant_key = if forge.is_some() {
        governed::grant::GrantKey::load_or_create(
            state.root(),
            std::env::var(governed::grant::KEY_ENV).ok(),
        )
        .map_err(|e| Error::Internal(e.to_string()))?
    } else {
        governed::grant::GrantKey::ephemeral().map_err(|e| Error::Internal(e.to_string()))?
    };
    // Every configured spec version stored (and checked) before any session can name one.
    let agents = agents::Agents::new(&config_path);
    agents.sync(&*store)?;
    let slack = match slack_config {
        Some((slack, secret, token)) => Some(Arc::new(ingress::Slack::new(
            slack,
            secret,
            token,
            vault.clone(),
        )?)),
        None => None,
    };
    // Before any session can be offered tools: the list every session sees is fixed here.
    let mcp = mcp::Mcp::start(mcp_servers, vault.clone()).await;
    let telemetry = Arc::new(match &config.telemetry.otlp_endpoint {
        Some(endpoint) => telemetry::Telemetry::with_traces(traces::Traces::exporting(
            traces::endpoint_url(endpoint).map_err(|message| {
                Error::Config(config::ConfigError::Invalid {
                    path: config_path.display().to_string(),
                    message,
                })
            })?,
            config
                .telemetry
                .service_name
                .clone()
                .unwrap_or_else(|| "skiff-gateway".to_owned()),
        )),
        None => telemetry::Telemetry::default(),
    });
    let hub = Arc::new(Hub::with_telemetry(
        store.clone(),
        telemetry.clone(),
        cluster.leases().clone(),
    ));
    let envs = Arc::new(environments::Environments::new(
        store.clone(),
        config.profiles,
        &provider_context(&state)?,
        state.root().join("ssh"),
    )?);
    let signer = worker::Signer::load_or_create(&state.root().join("worker-signing.key"))
        .map_err(|e| Error::Internal(format!("cannot load the worker signing key: {e}")))?;
    let session_processes = worker::SessionProcesses::default();
    let approvals = Arc::new(approvals::Approvals::new(
        config.gateway.approval.clone().unwrap_or_default(),
        approval_timeout,
    ));
    let fills = Arc::new(workspace::Fills::default());
    // The worker side reaches the core only through the handles it is lent, held weakly:
    // the core owns the worker side.
    let core = Arc::new_cyclic(|core: &std::sync::Weak<Core>| {
        let runs: std::sync::Weak<dyn worker::handles::Runs> = core.clone();
        let checkpoints: std::sync::Weak<dyn worker::handles::Checkpoints> = core.clone();
        let specs: std::sync::Weak<dyn worker::handles::TurnSpecs> = core.clone();
        let tools: std::sync::Weak<dyn worker::handles::GatewayTools> = core.clone();
        let workers = Arc::new(worker::WorkerSide::new(
            worker::Handles {
                store: store.clone(),
                hub: hub.clone(),
                envs: envs.clone(),
                egress_dir: state.root().join("egress"),
                tmp_dir: state.tmp(),
                artifacts_dir: state.artifacts(),
                session_processes: session_processes.clone(),
                fills: fills.clone(),
                vault: vault.clone(),
                barrier_fault,
                approvals: approvals::Revoker::new(store.clone(), hub.clone(), approvals.clone()),
                lent: worker::handles::Lent {
                    runs,
                    checkpoints,
                    specs,
                    tools,
                },
                hold: lock.clone(),
            },
            signer,
            state.root().join("workers"),
            config.gateway.max_workers.unwrap_or(16),
            config.gateway.web_fetch_allow.clone(),
            credential_ttl,
        ));
        Core {
            store,
            hub,
            catalog,
            state,
            tokens,
            shared_database: postgres.is_some(),
            running: Mutex::new(HashMap::new()),
            ui: ui::UiState::default(),
            envs,
            workers,
            _lock: lock,
            procs,
            turn_timeout,
            compact_at,
            max_children: config.gateway.max_children.unwrap_or(4),
            fills,
            restoring: Mutex::default(),
            git_credentials,
            vault,
            session_processes,
            mcp,
            governed: governed::Governed {
                key: grant_key,
                forge,
                clock: skiff_store::now_ms,
                skew_ms: std::sync::atomic::AtomicI64::new(0),
            },
            telemetry,
            approvals,
            budgets,
            audit_feed,
            audit_retention,
            local_sandbox,
            local_sandbox_paths,
            sandbox_warning,
            agents,
            slack,
            proxy,
            oidc,
            cluster,
            resumes: Mutex::default(),
            drained: CancellationToken::new(),
        }
    });
    core.envs
        .set_readiness(Arc::new(worker::probe::Probe(Arc::downgrade(
            &core.workers,
        ))));
    core.sweep_leftovers_on_start();
    // Nothing waits for an approval a previous process recorded — unless the session's turn
    // is another live gateway's, whose call still waits for its person.
    let orphaned = core.store.expire_orphaned_approvals(
        Some(core.cluster.id()),
        "the gateway restarted while the call waited",
    )?;
    if orphaned > 0 {
        tracing::info!(
            orphaned,
            "revoked approvals left pending by a previous gateway"
        );
    }
    core.reconcile_on_start()?;
    ownership::spawn_lease_loop(&core);
    // Before anything can read a workspace: a worktree a killed gateway was filling is
    // written whole again.
    core.recover_fills().await;
    // Adopting or failing environments left in flight, and destroying what no environment
    // owns, is one gateway's at a time (the sweeper's): a gateway joining a live one never
    // touches the boxes that one is placing; and even the sweeper leaves alone the boxes of
    // sessions another live gateway runs a turn of.
    let sweeper = core.holds_chore(chores::SWEEPER, lifetime_tick);
    // Placements of sessions another live gateway holds (a turn, or an attached worker):
    // theirs to keep, never reconciled here.
    let held_elsewhere: Vec<_> = core
        .store
        .live_placements()?
        .into_iter()
        .filter(|p| core.cluster.owns_elsewhere(&p.session_id))
        .collect();
    if sweeper {
        let elsewhere = held_elsewhere
            .iter()
            .filter_map(|p| p.environment_id.clone())
            .collect();
        core.envs.reconcile_on_start(&elsewhere).await?;
        core.envs.sweep_orphans().await?;
    } else {
        tracing::info!(
            "another gateway holds the sweeper: environments left in flight are its to reconcile"
        );
    }
    // Workers that re-attach are admitted against the bundle hash; without any, it is
    // computed at the first bring-up instead of delaying every start.
    if !core.store.live_placements()?.is_empty() {
        core.envs.warm_bundle().await;
    }
    let held_elsewhere = held_elsewhere.into_iter().map(|p| p.session_id).collect();
    core.workers
        .reconcile_placements_on_start(&held_elsewhere)
        .await?;
    // Boxes attached to no live placement now (a crash between attaching a box and recording
    // it, or mid-sync) are given up, never renewed for ever — by the sweeper only: another
    // gateway may be between attaching a box and recording it.
    if sweeper {
        core.envs.release_unowned_on_start().await?;
    }
    Ok((core, lifetime_tick, released))
}

/// Compiles `[gateway] approval` and every `[profiles.P] approval`: a pattern that is no glob
/// or regular expression fails the start, naming its key.
fn check_approval_policies(config_path: &std::path::Path, config: &Config) -> Result<()> {
    let invalid = |message: String| {
        Error::Config(config::ConfigError::Invalid {
            path: config_path.display().to_string(),
            message,
        })
    };
    if let Some(policy) = &config.gateway.approval {
        approvals::compile(policy, "gateway.approval").map_err(invalid)?;
    }
    for (name, profile) in &config.profiles {
        if let Some(policy) = &profile.approval {
            approvals::compile(policy, &format!("profiles.{name}.approval")).map_err(invalid)?;
        }
    }
    Ok(())
}

/// The hint a refused command of a gateway-placed session ends with.
pub(crate) const SANDBOX_HINT: &str = "; or, to run them unsandboxed as the gateway's own user \
    (who can read its state dir, database, token file and vault key), set `local_sandbox = \"off\"` \
    under `[gateway]` in skiff.toml";

/// What to tell the operator at start about the sandbox of gateway-placed sessions' commands:
/// nothing when it works, a warning when it is off or this host cannot make it.
async fn sandbox_warning(on: bool) -> Option<String> {
    let warning = if on {
        let reason = skiff_process::sandbox::probe().await.err()?;
        format!(
            "warning: this host cannot sandbox the tools of gateway-placed sessions ({reason}), so \
             their exec and process calls will be refused. Install bubblewrap (Debian/Ubuntu: \
             apt-get install bubblewrap) and allow user namespaces{SANDBOX_HINT}."
        )
    } else {
        "warning: `[gateway] local_sandbox = \"off\"`: the exec and process commands of \
         gateway-placed sessions run unsandboxed as the gateway's own user, and can read its state \
         dir (token file, database, vault key), other sessions' workspaces and its environment."
            .to_owned()
    };
    tracing::warn!("{warning}");
    Some(warning)
}

/// Kills the `exec` commands a previous gateway on this state dir left running (it crashed in
/// a way their parent-death signal missed), before anything of it can resume.
fn kill_leftover_processes(state: &StateDir) -> Result<skiff_process::Ledger> {
    let procs = skiff_process::Ledger::open(&state.root().join("procs"))?;
    for left in procs.kill_leftovers()? {
        tracing::warn!(pid = left.pid, command = %left.command, killed = left.killed,
            "killed a tool command left running by a previous gateway");
    }
    Ok(procs)
}

/// What providers need from this host: our executable, a private directory, the default root of
/// local boxes (outside the 0700 state dir when boxes get users of their own).
fn provider_context(state: &StateDir) -> Result<skiff_providers::Context> {
    let skiff_exe = std::env::current_exe()
        .map_err(|e| Error::Internal(format!("cannot locate the skiff executable: {e}")))?;
    Ok(skiff_providers::Context {
        skiff_exe,
        private_dir: state.root().join("keys"),
        default_box_root: default_box_root(state),
        state_dir: state.root().to_path_buf(),
    })
}

/// Where `local` profiles without a `root` keep their boxes.
fn default_box_root(state: &StateDir) -> PathBuf {
    if skiff_providers::running_as_root() {
        // One root per gateway (per state dir): a gateway's orphan sweep must never see
        // another gateway's boxes on the same host.
        let tag = blake3::hash(state.root().as_os_str().as_encoded_bytes()).to_hex();
        PathBuf::from(format!("/var/lib/skiff/boxes-{}", &tag[..12]))
    } else {
        state.root().join("boxes")
    }
}

/// Every `gateway.lifetime_tick`: park this gateway's worker sessions idle on their boxes
/// past `keep_attached`; and, on the gateway holding the `sweeper` lease, reclaim idle or
/// expired environments and renew leases in use.
fn spawn_lifetime_enforcer(core: &Arc<Core>, every: std::time::Duration) {
    // Weak: the tick keeps no gateway alive.
    let core = Arc::downgrade(core);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(core) = core.upgrade() else {
                return;
            };
            // Parking first: a box it gives back counts as used just now, so the reclaim
            // below never takes a box in the moment it is being given back. Parking is each
            // owner's (its own sessions); reclaim is one gateway's at a time.
            core.workers.park_idle_sessions().await;
            if core.holds_chore(chores::SWEEPER, every) {
                core.envs.enforce_lifetimes().await;
            }
        }
    });
}

impl Core {
    /// Runs left unfinished by a previous process on this gateway cannot be continuing: mark
    /// them (and their attempts) orphaned and tell anyone watching. So are runs of sessions
    /// whose lease is free or expired; never those of a session another live gateway holds.
    fn reconcile_on_start(&self) -> Result<()> {
        let orphaned = self.store.orphan_unleased_on_start(
            self.cluster.id(),
            "the gateway stopped while this run was active",
        )?;
        for (scope, run) in orphaned {
            tracing::warn!(run = %run.id, session = %run.session_id, "orphaned a run left active by a previous gateway");
            let event = EventKind::RunStatus {
                status: RunStatus::Orphaned,
                error: run.error.clone(),
            };
            self.hub
                .publish(&scope, &run.session_id, Some(&run.id), event)?;
            self.audit(
                &scope,
                "run.orphan",
                run.id.as_str(),
                "applied",
                serde_json::json!({ "session": run.session_id.as_str() }),
            );
        }
        Ok(())
    }

    /// The admin token for `gateway.json`: reused when the file holds a token this database
    /// knows. Otherwise a new one is minted (only its hash stored) — on the state dir's own
    /// SQLite database replacing the old (deleting `gateway.json` is how it is rotated); on a
    /// shared database only when it has none yet, so a gateway joining one never invalidates
    /// the token the others' operators hold, and gets `None` instead. The file always gets
    /// the current URL.
    fn admin_token(&self, url: &str) -> Result<Option<String>> {
        let path = self.state.gateway_file();
        let written = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| serde_json::from_str::<GatewayFile>(&text).ok())
            .and_then(|f| f.token);
        let existing = match written {
            Some(token) => match self.tokens.verify(&token)? {
                auth::Verified::Valid(_) => Some(token),
                auth::Verified::Expired(_) | auth::Verified::Unknown => None,
            },
            None => None,
        };
        let token = match existing {
            Some(token) => Some(token),
            None => {
                let token = auth::mint()?;
                let hash = blake3::hash(token.as_bytes()).to_hex();
                let minted = if self.shared_database {
                    self.store.add_token_if_absent(
                        auth::ADMIN_LABEL,
                        &hash,
                        &auth::admin_scope(),
                    )?
                } else {
                    self.store
                        .replace_token(auth::ADMIN_LABEL, &hash, &auth::admin_scope())?;
                    true
                };
                if minted {
                    self.audit(
                        &auth::admin_scope(),
                        "token.mint",
                        auth::ADMIN_LABEL,
                        "applied",
                        serde_json::json!({}),
                    );
                    Some(token)
                } else {
                    // `skiff gateway` tells the operator what to do, once, on stderr.
                    tracing::info!(
                        "joined a shared database whose admin token another gateway minted; gateway.json gets no token"
                    );
                    None
                }
            }
        };
        let file = GatewayFile {
            url: url.to_owned(),
            token: token.clone(),
        };
        let json =
            serde_json::to_string_pretty(&file).map_err(|e| Error::Internal(e.to_string()))?;
        self.state.write_gateway_file(&json)?;
        Ok(token)
    }
}
