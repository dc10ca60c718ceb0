//! The box's egress end to end: during setup a real `pip` installs a package from a registry on
//! the test's loopback, through the gateway's egress proxy (the box has no network of its own;
//! the proxy is reached through a forward of the box's own SSH connection), and a real `curl`
//! fetches over HTTPS through a CONNECT tunnel with a test CA; hosts that are not listed, names
//! that resolve to loopback and the metadata address get a readable 403; after setup the
//! forward is gone, and the agent's `exec` is held to `egress.agent`.

use crate::harness::{stderr, stdout};
use crate::worker::{Rig, new_worker_session, text_reply, tool_reply};
use serde_json::Value;
use skiff_test_support::TempGitRepo;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A Python static file server on 127.0.0.1 (plain HTTP, or HTTPS with `cert`), stopped on drop.
struct Registry {
    child: Child,
    port: u16,
}

impl Registry {
    fn start(dir: &Path, tls: Option<(&Path, &Path)>) -> Registry {
        let wrap = match tls {
            Some((cert, key)) => format!(
                "ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain({:?}, {:?}); \
                 s.socket = ctx.wrap_socket(s.socket, server_side=True); ",
                cert.display().to_string(),
                key.display().to_string()
            ),
            None => String::new(),
        };
        let script = format!(
            "import functools, http.server, ssl, sys\n\
             h = functools.partial(http.server.SimpleHTTPRequestHandler, directory={:?})\n\
             s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), h)\n\
             {wrap}\n\
             print(s.server_address[1], flush=True)\n\
             s.serve_forever()\n",
            dir.display().to_string()
        );
        let mut child = Command::new("python3")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("{line:?}"));
        Registry { child, port }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A wheel of `skiffdemo` 1.0 in `dir`, as `pip` expects one.
fn build_wheel(dir: &Path) {
    let script = r#"
import base64, hashlib, sys, zipfile
files = {
    "skiffdemo/__init__.py": b"VALUE = 'from-the-registry'\n",
    "skiffdemo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: skiffdemo\nVersion: 1.0\n",
    "skiffdemo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: skiff-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, data in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(data)}\n"
record += "skiffdemo-1.0.dist-info/RECORD,,\n"
with zipfile.ZipFile(sys.argv[1] + "/skiffdemo-1.0-py3-none-any.whl", "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
    z.writestr("skiffdemo-1.0.dist-info/RECORD", record)
"#;
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
}

/// A self-signed certificate for 127.0.0.1 (the test's CA) and its key.
fn test_certificate(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join("ca.pem"), dir.join("key.pem"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    (cert, key)
}

fn tool_results(rig: &Rig, id: &str) -> Vec<String> {
    let detail = rig.gw.json(&["session", "show", "--json", id]);
    detail["transcript"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["body"]["kind"] == "tool_result")
        .map(|e| e["body"]["content"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn setup_installs_through_the_egress_proxy_and_the_agent_is_held_to_its_own_list() {
    let files = tempfile::tempdir().unwrap();
    build_wheel(files.path());
    std::fs::write(files.path().join("hello.txt"), "over https\n").unwrap();
    let certs = tempfile::tempdir().unwrap();
    let (cert, key) = test_certificate(certs.path());
    let plain = Registry::start(files.path(), None);
    let tls = Registry::start(files.path(), Some((&cert, &key)));

    let setup = format!(
        "set -e\n\
         python3 -m pip install --user --break-system-packages --no-index \
           --find-links http://127.0.0.1:{plain}/ skiffdemo\n\
         curl -sS --fail --cacert .skiff/ca.pem https://127.0.0.1:{tls}/hello.txt\n\
         echo \"unlisted: $(curl -s http://pypi.example.invalid/simple/)\"\n\
         echo \"loopback name: $(curl -s --noproxy '' -x \"$HTTP_PROXY\" http://localhost:{plain}/)\"\n\
         echo \"metadata: $(curl -s -x \"$HTTP_PROXY\" http://169.254.169.254/latest/meta-data/)\"\n",
        plain = plain.port,
        tls = tls.port
    );
    let rig = Rig::start(
        vec![
            tool_reply(
                "call_1",
                "exec",
                r#"{"command":"python3 -c 'import skiffdemo; print(skiffdemo.VALUE)'"}"#,
            ),
            tool_reply(
                "call_2",
                "exec",
                &format!(
                    r#"{{"command":"curl -s -i http://127.0.0.1:{}/hello.txt"}}"#,
                    plain.port
                ),
            ),
            text_reply(&["Installed and checked."]),
        ],
        "egress = { setup = [\"127.0.0.1\"], agent = [\"pypi.org\"] }\n",
    );
    let repo = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        (".skiff/setup.sh", &setup),
        (".skiff/ca.pem", &std::fs::read_to_string(&cert).unwrap()),
    ]);

    let (out, id) = new_worker_session(&rig, repo.path(), "Use the package");
    assert!(out.status.success(), "{}", stderr(&out));
    let log = rig.gw.json(&["session", "setup-log", "--json", &id]);
    let log = log["text"].as_str().unwrap();
    assert!(
        log.contains("Successfully installed skiffdemo-1.0"),
        "{log}"
    );
    assert!(log.contains("over https"), "{log}");
    // Refusals a person (or an agent) can act on: the host and the key that would allow it.
    assert!(
        log.contains("unlisted: skiff egress: refused pypi.example.invalid:80")
            && log.contains("profiles.local.egress.setup"),
        "{log}"
    );
    assert!(
        log.contains(
            "[skiff] the egress proxy refused 1 request(s) to pypi.example.invalid: to allow it, \
             add \"pypi.example.invalid\" to profiles.local.egress.setup"
        ),
        "{log}"
    );
    let line = |prefix: &str| {
        log.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line in {log}"))
            .to_owned()
    };
    assert!(line("loopback name:").contains("loopback"), "{log}");
    assert!(line("metadata:").contains("169.254.169.254"), "{log}");
    assert!(line("metadata:").contains("refused"), "{log}");

    // The agent has what setup installed, and only `egress.agent` beyond that.
    let results = tool_results(&rig, &id);
    assert!(results[0].contains("from-the-registry"), "{results:?}");
    assert!(results[1].contains("403"), "{}", results[1]);
    assert!(
        results[1].contains("profiles.local.egress.agent"),
        "{}",
        results[1]
    );
    assert!(!results[1].contains("over https"));

    // Per-host counters for both phases.
    let env =
        rig.gw.json(&["session", "show", "--json", &id])["session"]["worker"]["environment_id"]
            .as_str()
            .map(str::to_owned);
    let env = env.unwrap_or_else(|| {
        let list = rig.gw.json(&["env", "list", "--json"]);
        list["environments"][0]["id"].as_str().unwrap().to_owned()
    });
    let shown = rig.gw.json(&["env", "show", "--json", &env]);
    let hosts = shown["egress_hosts"].as_array().unwrap();
    let find = |phase: &str, host: &str| -> &Value {
        hosts
            .iter()
            .find(|h| h["phase"] == phase && h["host"] == host)
            .unwrap_or_else(|| panic!("no {phase} {host} in {hosts:?}"))
    };
    let setup_local = find("setup", "127.0.0.1");
    assert!(
        setup_local["connections"].as_u64().unwrap() >= 2,
        "{hosts:?}"
    );
    assert!(
        setup_local["bytes_in"].as_u64().unwrap() > 1000,
        "{hosts:?}"
    );
    assert_eq!(find("setup", "pypi.example.invalid")["refused"], 1);
    assert_eq!(find("agent", "127.0.0.1")["refused"], 1);
    let human = rig.gw.run(&["env", "show", &env]);
    assert!(
        stdout(&human).contains("pypi.example.invalid"),
        "{}",
        stdout(&human)
    );
}

#[test]
fn without_agent_egress_the_forward_is_gone_once_setup_ends() {
    let rig = Rig::start(
        vec![
            tool_reply(
                "call_1",
                "exec",
                r#"{"command":"env | grep -ci proxy; ss -Hltn | wc -l"}"#,
            ),
            text_reply(&["Checked."]),
        ],
        "",
    );
    let repo = TempGitRepo::new(&[
        ("README.md", "a repo\n"),
        (
            ".skiff/setup.sh",
            "echo \"proxy $HTTPS_PROXY\"\nbash -c \"exec 3<>/dev/tcp/127.0.0.1/${HTTPS_PROXY##*:}\" && echo reachable\n",
        ),
    ]);
    let (out, id) = new_worker_session(&rig, repo.path(), "Check");
    assert!(out.status.success(), "{}", stderr(&out));
    let log = rig.gw.json(&["session", "setup-log", "--json", &id]);
    let log = log["text"].as_str().unwrap();
    assert!(log.contains("proxy http://127.0.0.1:"), "{log}");
    assert!(log.contains("reachable"), "{log}");
    // In the agent phase: no proxy variables, and nothing listens on the box but its sshd.
    let results = tool_results(&rig, &id);
    let lines: Vec<&str> = results[0].lines().skip(1).map(str::trim).collect();
    assert_eq!(lines, ["0", "1"], "{}", results[0]);
}
