//! Which paths take part in sync: built-in excludes (`.git` internals, `target`,
//! `node_modules`, `.venv`, `__pycache__`, `dist`, …) and then `.skiffignore` at the workspace
//! root.
//!
//! A rule is one line: `#` starts a comment, `!` re-includes, a trailing `/` matches
//! directories only. A pattern without `/` matches any path segment (`*.log`, `build`); a
//! pattern with `/` is anchored at the root (`docs/out`, `/notes.txt`). A rule that matches a
//! directory matches everything below it. The last matching rule wins, and a path no rule
//! matches is included. `.git` is excluded outside the rules: nothing can re-include it.
//!
//! Deliberately absent: `.gitignore` semantics such as "a file under an excluded directory
//! cannot be re-included" — here it can, which is what people expect of `!`.

use crate::{Error, Result, io_err};
use globset::{Glob, GlobBuilder, GlobMatcher, GlobSet, GlobSetBuilder};
use std::path::Path;

/// Excluded unless a `.skiffignore` rule re-includes them: build outputs and caches that are
/// large, machine-specific, and rebuilt on the box. A rule with markers is build output only
/// beside one of them (`target/` next to a `Cargo.toml`): a source folder that happens to be
/// called `target` or `dist` (the `cc` crate has `src/target/`) is source, and is synced.
pub const BUILTIN: &[(&str, &[&str])] = &[
    ("target/", &["Cargo.toml", "pom.xml"]),
    ("node_modules/", &[]),
    (".venv/", &[]),
    ("__pycache__/", &[]),
    (
        "dist/",
        &["package.json", "pyproject.toml", "setup.py", "setup.cfg"],
    ),
    (".tox/", &[]),
    (".mypy_cache/", &[]),
    (".pytest_cache/", &[]),
    (".gradle/", &[]),
    (".next/", &["package.json"]),
    ("*.pyc", &[]),
    (".DS_Store", &[]),
];

/// The file at the workspace root that adds rules.
pub const FILE: &str = ".skiffignore";

#[derive(Clone, Debug)]
struct Rule {
    negated: bool,
    anchored: bool,
    dir_only: bool,
    glob: GlobMatcher,
    /// The same pattern, for the rule set's [`Index`].
    pattern: Glob,
    /// A built-in build-output rule matches a directory only when one of these files sits
    /// beside it (checked under the workspace root; without a root, always).
    beside: &'static [&'static str],
    /// The line as written, for telling people which rule left a path out.
    text: String,
}

impl Rule {
    fn parse(line: &str) -> std::result::Result<Option<Rule>, String> {
        let line = line.trim_end();
        if line.trim().is_empty() || line.starts_with('#') {
            return Ok(None);
        }
        let (negated, rest) = match line.strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, line.strip_prefix('\\').unwrap_or(line)),
        };
        let (dir_only, rest) = match rest.strip_suffix('/') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let anchored = rest.contains('/');
        let pattern = rest.strip_prefix('/').unwrap_or(rest);
        if pattern.is_empty() {
            return Err("the pattern is empty".into());
        }
        let pattern = GlobBuilder::new(pattern)
            .literal_separator(true)
            .backslash_escape(true)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Some(Rule {
            negated,
            anchored,
            dir_only,
            glob: pattern.compile_matcher(),
            pattern,
            beside: &[],
            text: line.to_owned(),
        }))
    }

    /// Whether the rule matches `path` (a `/`-separated relative path) or a directory above it.
    /// `root` is the workspace the path is in, for rules that look beside what they match.
    fn matches(&self, path: &str, is_dir: bool, root: Option<&Path>) -> bool {
        let parts: Vec<&str> = path.split('/').collect();
        let last = parts.len().saturating_sub(1);
        if self.anchored {
            let mut end = 0;
            for (i, part) in parts.iter().enumerate() {
                end += part.len() + usize::from(i > 0);
                if (i < last || is_dir || !self.dir_only) && self.glob.is_match(&path[..end]) {
                    return true;
                }
            }
            false
        } else {
            parts.iter().enumerate().any(|(i, part)| {
                (i < last || is_dir || !self.dir_only)
                    && self.glob.is_match(part)
                    && self.is_beside_marker(root, &parts[..i])
            })
        }
    }
}

impl Rule {
    /// Whether the directory `parent` (segments below `root`) holds one of the rule's markers.
    fn is_beside_marker(&self, root: Option<&Path>, parent: &[&str]) -> bool {
        let Some(root) = root.filter(|_| !self.beside.is_empty()) else {
            return true;
        };
        let dir = parent.iter().fold(root.to_path_buf(), |d, p| d.join(p));
        self.beside.iter().any(|m| dir.join(m).is_file())
    }
}

/// [`Rules::excluded`] for many paths at once (see [`Rules::matcher`]).
pub struct Matcher<'a> {
    rules: &'a Rules,
    /// Folder → the last rule its own segments match (as a folder), and whether one of them
    /// is `.git`.
    folders: std::collections::HashMap<String, (Option<usize>, bool)>,
    hits: Vec<usize>,
}

impl Matcher<'_> {
    /// [`Rules::excluded`] of `path`.
    pub fn excluded(&mut self, path: &str, is_dir: bool) -> bool {
        let rules = self.rules;
        let (Some(index), Some((folder, name))) = (&rules.index, path.rsplit_once('/')) else {
            return rules.excluded(path, is_dir);
        };
        // Every segment of the folder is matched as a folder whatever follows it: its
        // decision is the folder's own (`last_match_in` of the folder as a directory).
        let (mut best, git) = match self.folders.get(folder) {
            Some(known) => *known,
            None => {
                let known = (
                    rules.last_match_in(folder, true, rules.root.as_deref()),
                    folder.split('/').any(|p| p == ".git"),
                );
                self.folders.insert(folder.to_owned(), known);
                known
            }
        };
        if git || name == ".git" {
            return true;
        }
        // The last segment, as `last_match_in` asks it.
        index.segments.matches_into(name, &mut self.hits);
        let mut parent = None;
        for &n in &self.hits {
            let r = index.segment_rules[n];
            let rule = &rules.rules[r];
            if best.is_none_or(|b| r > b) && (is_dir || !rule.dir_only) {
                let parts = parent.get_or_insert_with(|| folder.split('/').collect::<Vec<_>>());
                if rule.is_beside_marker(rules.root.as_deref(), parts) {
                    best = Some(r);
                }
            }
        }
        index.anchored.matches_into(path, &mut self.hits);
        for &n in &self.hits {
            let r = index.anchored_rules[n];
            if best.is_none_or(|b| r > b) && (is_dir || !rules.rules[r].dir_only) {
                best = Some(r);
            }
        }
        best.is_some_and(|i| !rules.rules[i].negated)
    }
}

/// An ordered rule list: built-ins first, then `.skiffignore`.
#[derive(Clone, Debug)]
pub struct Rules {
    rules: Vec<Rule>,
    /// The workspace the rules are for (set by [`Rules::load`]): built-ins with markers look
    /// there.
    root: Option<std::path::PathBuf>,
    /// Every rule's pattern in one matcher, so a path is matched once per segment rather than
    /// once per rule and segment (`None`: each rule is asked, in order).
    index: Option<Index>,
}

/// The rules' patterns as two sets: those matched against each path segment, and the
/// anchored ones matched against each leading part of a path.
#[derive(Clone, Debug)]
struct Index {
    segments: GlobSet,
    /// Rule number of each pattern of `segments`.
    segment_rules: Vec<usize>,
    anchored: GlobSet,
    anchored_rules: Vec<usize>,
}

impl Index {
    fn of(rules: &[Rule]) -> Option<Index> {
        let (mut segments, mut anchored) = (GlobSetBuilder::new(), GlobSetBuilder::new());
        let (mut segment_rules, mut anchored_rules) = (Vec::new(), Vec::new());
        for (i, rule) in rules.iter().enumerate() {
            if rule.anchored {
                anchored.add(rule.pattern.clone());
                anchored_rules.push(i);
            } else {
                segments.add(rule.pattern.clone());
                segment_rules.push(i);
            }
        }
        Some(Index {
            segments: segments.build().ok()?,
            segment_rules,
            anchored: anchored.build().ok()?,
            anchored_rules,
        })
    }
}

impl Default for Rules {
    fn default() -> Self {
        Self::builtin()
    }
}

impl Rules {
    /// The built-in excludes alone.
    pub fn builtin() -> Rules {
        let rules: Vec<Rule> = BUILTIN
            .iter()
            .filter_map(|(p, beside)| {
                let mut rule = Rule::parse(p).ok().flatten()?;
                rule.beside = beside;
                Some(rule)
            })
            .collect();
        Rules {
            index: Index::of(&rules),
            rules,
            root: None,
        }
    }

    /// The built-ins followed by the rules in `text` (the contents of a `.skiffignore`).
    pub fn parse(text: &str) -> Result<Rules> {
        let mut rules = Self::builtin();
        for (i, line) in text.lines().enumerate() {
            match Rule::parse(line) {
                Ok(Some(rule)) => rules.rules.push(rule),
                Ok(None) => {}
                Err(detail) => {
                    return Err(Error::Rule {
                        line: i + 1,
                        pattern: line.to_owned(),
                        detail,
                    });
                }
            }
        }
        rules.index = Index::of(&rules.rules);
        Ok(rules)
    }

    /// The built-ins followed by `root/.skiffignore`, when it exists.
    pub fn load(root: &Path) -> Result<Rules> {
        let path = root.join(FILE);
        let mut rules = match std::fs::read_to_string(&path) {
            Ok(text) => Self::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::builtin()),
            Err(e) => Err(io_err(&path)(e)),
        }?;
        rules.root = Some(root.to_path_buf());
        Ok(rules)
    }

    /// The index of the last rule that matches, if any.
    fn last_match(&self, path: &str, is_dir: bool) -> Option<usize> {
        self.last_match_in(path, is_dir, self.root.as_deref())
    }

    /// `last_match` with rules' markers looked for under `root` (`None`: always beside).
    fn last_match_in(&self, path: &str, is_dir: bool, root: Option<&Path>) -> Option<usize> {
        let Some(index) = &self.index else {
            return self
                .rules
                .iter()
                .rposition(|r| r.matches(path, is_dir, root));
        };
        // What `Rule::matches` asks of every rule, asked of all rules at once.
        let parts: Vec<&str> = path.split('/').collect();
        let last = parts.len().saturating_sub(1);
        let mut best: Option<usize> = None;
        let mut hits = Vec::new();
        let mut end = 0;
        for (i, part) in parts.iter().enumerate() {
            end += part.len() + usize::from(i > 0);
            index.segments.matches_into(part, &mut hits);
            for &n in &hits {
                let r = index.segment_rules[n];
                let rule = &self.rules[r];
                if best.is_none_or(|b| r > b)
                    && (i < last || is_dir || !rule.dir_only)
                    && rule.is_beside_marker(root, &parts[..i])
                {
                    best = Some(r);
                }
            }
            index.anchored.matches_into(&path[..end], &mut hits);
            for &n in &hits {
                let r = index.anchored_rules[n];
                if best.is_none_or(|b| r > b) && (i < last || is_dir || !self.rules[r].dir_only) {
                    best = Some(r);
                }
            }
        }
        best
    }

    /// Whether `path` (relative, `/`-separated) stays out of sync.
    pub fn excluded(&self, path: &str, is_dir: bool) -> bool {
        if path.split('/').any(|p| p == ".git") {
            return true;
        }
        self.last_match(path, is_dir)
            .is_some_and(|i| !self.rules[i].negated)
    }

    /// A matcher for the many paths of one listing: what a folder's own segments decide is
    /// worked out once per folder, and only each file's name is matched after that. It
    /// decides exactly as [`Rules::excluded`] does (markers are looked for once per folder,
    /// when the matcher first meets it).
    pub fn matcher(&self) -> Matcher<'_> {
        Matcher {
            rules: self,
            folders: std::collections::HashMap::new(),
            hits: Vec::new(),
        }
    }

    /// Whether `path` syncs here only because a built-in rule's marker file is missing beside
    /// it (a source folder named `target/` with no `Cargo.toml` next to it): on a side that
    /// has the marker — a box that just made one — the same rules leave it out, so its absence
    /// from that side's manifest is not a deletion.
    pub fn may_be_left_out_elsewhere(&self, path: &str) -> bool {
        if self.excluded(path, false) {
            return false;
        }
        self.last_match_in(path, false, None)
            .is_some_and(|i| !self.rules[i].negated)
    }

    /// The rule that leaves `path` out, as people read it (`target/ (beside Cargo.toml)`,
    /// `*.log (.skiffignore)`), or `None` when the path syncs.
    pub fn excluding_rule(&self, path: &str, is_dir: bool) -> Option<String> {
        if path.split('/').any(|p| p == ".git") {
            return Some(".git (git internals never sync)".into());
        }
        let i = self.last_match(path, is_dir)?;
        let rule = &self.rules[i];
        if rule.negated {
            return None;
        }
        let origin = if i < BUILTIN.len() {
            match rule.beside {
                [] => "built in".to_owned(),
                markers => format!("built in, beside {}", markers.join(" or ")),
            }
        } else {
            FILE.to_owned()
        };
        Some(format!("{} ({origin})", rule.text))
    }

    /// Whether a walk must still look inside the excluded directory `dir`: a later `!` rule
    /// might re-include something below it.
    pub fn may_reinclude_below(&self, dir: &str) -> bool {
        if dir.split('/').any(|p| p == ".git") {
            return false;
        }
        let from = self.last_match(dir, true).map_or(0, |i| i + 1);
        self.rules[from..].iter().any(|r| r.negated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_listing_matcher_looks_for_markers_per_folder() {
        let root = tempfile::tempdir().unwrap();
        for dir in ["crate/target", "src/target", "web/dist", "docs/dist"] {
            std::fs::create_dir_all(root.path().join(dir)).unwrap();
        }
        std::fs::write(root.path().join("crate/Cargo.toml"), "").unwrap();
        std::fs::write(root.path().join("web/package.json"), "").unwrap();
        std::fs::write(root.path().join(".skiffignore"), "*.tmp\n!keep.tmp\n").unwrap();
        let rules = Rules::load(root.path()).unwrap();
        let mut matcher = rules.matcher();
        for (path, out) in [
            ("crate/target/debug/x", true),
            ("crate/target/y", true),
            ("src/target/lib.rs", false),
            ("src/target/other.rs", false),
            ("web/dist/app.js", true),
            ("docs/dist/index.html", false),
            ("crate/a.tmp", true),
            ("crate/keep.tmp", false),
            ("crate/.git/config", true),
            ("top.tmp", true),
        ] {
            assert_eq!(matcher.excluded(path, false), out, "{path}");
            assert_eq!(rules.excluded(path, false), out, "{path}");
        }
    }

    #[test]
    fn builtins_and_segments() {
        let rules = Rules::parse("*.log\n/notes.txt\ndocs/out/\n!keep.log\n").unwrap();
        assert!(rules.excluded("target/debug/x", false));
        assert!(rules.excluded("sub/node_modules/a/b.js", false));
        assert!(rules.excluded(".git/config", false));
        assert!(rules.excluded("a/.git", true));
        assert!(rules.excluded("a/b/c.log", false));
        assert!(!rules.excluded("a/b/keep.log", false));
        assert!(rules.excluded("notes.txt", false));
        assert!(!rules.excluded("sub/notes.txt", false));
        assert!(rules.excluded("docs/out/index.html", false));
        assert!(
            !rules.excluded("docs/out", false),
            "dir-only rule on a file"
        );
        assert!(!rules.excluded("src/main.rs", false));
        // `target` as a file is not a directory: the built-in is dir-only.
        assert!(!rules.excluded("target", false));
    }

    #[test]
    fn re_include_below_an_excluded_directory() {
        let rules = Rules::parse("!target/keep.txt\n").unwrap();
        assert!(!rules.excluded("target/keep.txt", false));
        assert!(rules.excluded("target/other", false));
        assert!(rules.may_reinclude_below("target"));
        assert!(!Rules::builtin().may_reinclude_below("target"));
        assert!(!rules.may_reinclude_below(".git"));
        let rules = Rules::parse("!.git/config\n").unwrap();
        assert!(
            rules.excluded(".git/config", false),
            ".git is never re-included"
        );
    }

    #[test]
    fn build_output_rules_look_beside_what_they_match() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for d in ["crate/target", "crate/src/target", "web/dist", "lib/dist"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        std::fs::write(root.join("crate/Cargo.toml"), "").unwrap();
        std::fs::write(root.join("web/package.json"), "").unwrap();
        let rules = Rules::load(root).unwrap();
        assert!(rules.excluded("crate/target/debug/x", false));
        assert!(!rules.excluded("crate/src/target/mod.rs", false), "source");
        assert!(rules.excluded("web/dist/app.js", false));
        assert!(!rules.excluded("lib/dist/util.py", false), "source");
        assert!(rules.excluded("any/where/node_modules/a.js", false));
        assert!(rules.excluded("x/__pycache__/m.pyc", false));
    }

    #[test]
    fn bad_patterns_name_their_line() {
        let err = Rules::parse("ok\n[\n").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }

    fn pattern() -> impl Strategy<Value = String> {
        let seg = prop_oneof![
            Just("a".to_owned()),
            Just("b".to_owned()),
            Just("*.log".to_owned()),
            Just("x*".to_owned()),
            Just("*".to_owned()),
        ];
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            prop::collection::vec(seg, 1..3),
        )
            .prop_map(|(neg, lead, dir, segs)| {
                let mut p = String::new();
                if neg {
                    p.push('!');
                }
                if lead {
                    p.push('/');
                }
                p.push_str(&segs.join("/"));
                if dir {
                    p.push('/');
                }
                p
            })
    }

    fn path() -> impl Strategy<Value = String> {
        let seg = prop_oneof![
            Just("a"),
            Just("b"),
            Just("c.log"),
            Just("xy"),
            Just("target")
        ];
        prop::collection::vec(seg, 1..4).prop_map(|s| s.join("/"))
    }

    proptest! {
        /// Last match wins: appending a rule decides exactly the paths it matches, with its own
        /// polarity, and leaves every other path as it was.
        #[test]
        fn appending_a_rule_decides_only_what_it_matches(
            base in prop::collection::vec(pattern(), 0..5),
            extra in pattern(),
            path in path(),
            is_dir in any::<bool>(),
        ) {
            let before = Rules::parse(&base.join("\n")).unwrap();
            let after = Rules::parse(&format!("{}\n{extra}", base.join("\n"))).unwrap();
            let rule = Rule::parse(&extra).unwrap().unwrap();
            let expected = if rule.matches(&path, is_dir, None) {
                !rule.negated
            } else {
                before.excluded(&path, is_dir)
            };
            prop_assert_eq!(after.excluded(&path, is_dir), expected);
        }

        /// Repeating the whole rule list changes nothing.
        #[test]
        fn rules_are_idempotent(
            base in prop::collection::vec(pattern(), 0..5),
            path in path(),
            is_dir in any::<bool>(),
        ) {
            let once = Rules::parse(&base.join("\n")).unwrap();
            let twice = Rules::parse(&format!("{0}\n{0}", base.join("\n"))).unwrap();
            prop_assert_eq!(once.excluded(&path, is_dir), twice.excluded(&path, is_dir));
        }

        /// One matcher over many paths (folders shared, `.git` among them) decides each
        /// as `excluded` does.
        #[test]
        fn a_listing_matcher_decides_as_excluded(
            base in prop::collection::vec(pattern(), 0..6),
            paths in prop::collection::vec(
                prop_oneof![path(), path().prop_map(|p| format!("{p}/.git/x"))],
                1..12,
            ),
            is_dir in any::<bool>(),
        ) {
            let rules = Rules::parse(&base.join("\n")).unwrap();
            let mut matcher = rules.matcher();
            for path in &paths {
                prop_assert_eq!(matcher.excluded(path, is_dir), rules.excluded(path, is_dir), "{}", path);
            }
        }

        /// The rules matched all at once decide as each rule asked in turn does.
        #[test]
        fn the_index_decides_as_the_rules_in_turn(
            base in prop::collection::vec(pattern(), 0..6),
            path in path(),
            is_dir in any::<bool>(),
        ) {
            let indexed = Rules::parse(&base.join("\n")).unwrap();
            let mut in_turn = indexed.clone();
            in_turn.index = None;
            prop_assert!(indexed.index.is_some());
            prop_assert_eq!(
                indexed.last_match_in(&path, is_dir, None),
                in_turn.last_match_in(&path, is_dir, None)
            );
        }
    }
}
