//! The documentation's links resolve: every relative link and `#anchor` in README.md,
//! docs/*.md and the examples' READMEs names a file of the repository and, where it has an
//! anchor, a heading of that file (GitHub's anchors: lower case, punctuation dropped, spaces
//! as hyphens, `-1`, `-2` for repeated headings). Links in code blocks and code spans are
//! text, not links; web links are not fetched (CI has no business depending on other sites).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The markdown files whose links are checked.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    for folder in ["docs", "examples"] {
        let Ok(entries) = std::fs::read_dir(root.join(folder)) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            } else if path.join("README.md").is_file() {
                files.push(path.join("README.md"));
            }
        }
    }
    files.sort();
    files
}

/// The text of a markdown file outside fenced code blocks, line by line (code blocks become
/// empty lines, so line numbers stay).
fn prose_lines(text: &str) -> Vec<String> {
    let mut fence: Option<&str> = None;
    text.lines()
        .map(|line| {
            let trimmed = line.trim_start();
            match fence {
                Some(marker) => {
                    if trimmed.starts_with(marker) {
                        fence = None;
                    }
                    String::new()
                }
                None if trimmed.starts_with("```") || trimmed.starts_with("~~~") => {
                    fence = Some(&trimmed[..3]);
                    String::new()
                }
                None => strip_code_spans(line),
            }
        })
        .collect()
}

/// `line` without its code spans (`` `[a](b)` `` is text).
fn strip_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// GitHub's anchor of a heading's text.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a markdown file's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut anchors = BTreeSet::new();
    for line in prose_lines(&text.replace('`', "")) {
        let Some(rest) = line.strip_prefix('#') else {
            continue;
        };
        let heading = rest.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while !seen.insert(anchor.clone()) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        anchors.insert(anchor);
    }
    anchors
}

/// The targets of the inline links and images of a line: `[text](target)`, `![alt](target)`,
/// without a title (`(target "title")`).
fn link_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else {
            break;
        };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        let target = target.trim_start_matches('<').trim_end_matches('>');
        if !target.is_empty() {
            targets.push(target.to_string());
        }
        rest = &after[end..];
    }
    targets
}

/// Every broken relative link of `files`, as "file:line: target (why)".
fn broken_links(files: &[PathBuf]) -> Vec<String> {
    let mut broken = Vec::new();
    for file in files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (number, line) in prose_lines(&text).iter().enumerate() {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match target.split_once('#') {
                    Some((path, anchor)) => (path, Some(anchor)),
                    None => (target.as_str(), None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().unwrap().join(path)
                };
                let at = format!("{}:{}: {target}", file.display(), number + 1);
                if !resolved.exists() {
                    broken.push(format!("{at} (no such file)"));
                    continue;
                }
                let Some(anchor) = anchor else {
                    continue;
                };
                if resolved.extension().is_some_and(|e| e == "md") {
                    let target_text = std::fs::read_to_string(&resolved).unwrap();
                    if !anchors(&target_text).contains(anchor) {
                        broken.push(format!("{at} (no heading with that anchor)"));
                    }
                }
            }
        }
    }
    broken
}

#[test]
fn every_relative_link_and_anchor_of_the_docs_resolves() {
    let root = repository();
    let files = documents(&root);
    assert!(
        files.len() >= 9,
        "README.md and the docs/ folder: {files:?}"
    );
    let broken = broken_links(&files);
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The checker finds what it must: a missing file, a missing anchor, and not a link in code.
#[test]
fn the_link_check_finds_broken_links() {
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("a.md");
    std::fs::write(
        dir.path().join("b.md"),
        "# Set-up: two commands\n\n## `cargo xtask` (CPU)\n\n## Set-up: two commands\n",
    )
    .unwrap();
    std::fs::write(
        &doc,
        "# Top\n\
         [ok](b.md#set-up-two-commands) [ok](b.md#cargo-xtask-cpu) [ok](b.md#set-up-two-commands-1) \
         [ok](#top) ![img](b.md)\n\
         [bad](c.md) [bad](b.md#nowhere) [bad](#bottom)\n\
         `[code](nowhere.md)`\n\
         ```\n[fenced](nowhere.md)\n```\n\
         [web](https://example.com/x.md)\n",
    )
    .unwrap();
    let broken = broken_links(&[doc]);
    assert_eq!(broken.len(), 3, "{broken:#?}");
    assert!(broken[0].ends_with("c.md (no such file)"), "{broken:?}");
    assert!(broken[1].contains("b.md#nowhere"), "{broken:?}");
    assert!(broken[2].contains("#bottom"), "{broken:?}");
}
