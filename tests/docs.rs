//! The documentation stands alone in a clone: every relative link in README.md, docs/*.md and
//! the crates' and folders' READMEs names a file of the repository (and, with `#anchor`, a
//! heading of it), no Markdown file points at the team's shared folder outside the repository
//! or at a folder of the machine it was written on, and README stays a front door with the two
//! set-up commands.

use std::collections::HashSet;
use std::fs;
use std::path::{Component, Path, PathBuf};

/// The repository's root (this test's package is `cli/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
        .to_path_buf()
}

/// README.md, every docs/*.md and the README.md of each top-level folder (the crates',
/// `openapi/`, `migrations/`): the pages whose links are checked.
fn pages() -> Vec<PathBuf> {
    let root = root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    assert!(!docs.is_empty(), "docs/ holds Markdown pages");
    pages.extend(docs);
    let mut readmes: Vec<PathBuf> = fs::read_dir(&root)
        .unwrap()
        .map(|entry| entry.unwrap().path().join("README.md"))
        .filter(|readme| readme.is_file())
        .collect();
    readmes.sort();
    assert!(
        readmes.iter().any(|r| r.ends_with("kernels/README.md")),
        "the crates' READMEs are read"
    );
    pages.extend(readmes);
    pages
}

/// Every Markdown file of the repository, outside build output and hidden folders.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" && name != "node_modules" {
                markdown_files(&path, out);
            }
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// The text with fenced and indented code blocks blanked (lines kept, so line numbers hold).
fn prose(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<&str> = None;
    let mut previous_blank_or_code = true;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let is_code = if let Some(marker) = fence {
            if trimmed.starts_with(marker) {
                fence = None;
            }
            true
        } else if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fence = Some(&trimmed[..3]);
            true
        } else {
            // An indented code block: four spaces after a blank line (or more code).
            line.starts_with("    ") && previous_blank_or_code
        };
        previous_blank_or_code = is_code || line.trim().is_empty();
        if !is_code {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The text with inline code spans blanked (they may run over line ends).
fn without_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let run = chars[i..].iter().take_while(|&&c| c == '`').count();
        // The closing run of the same length, if any.
        let mut j = i + run;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let len = chars[j..].iter().take_while(|&&c| c == '`').count();
                if len == run {
                    close = Some(j + len);
                    break;
                }
                j += len;
            } else {
                j += 1;
            }
        }
        match close {
            Some(end) => {
                // Keep the line breaks so line numbers hold.
                out.extend(chars[i..end].iter().filter(|&&c| c == '\n'));
                i = end;
            }
            None => {
                out.extend(&chars[i..i + run]);
                i += run;
            }
        }
    }
    out
}

/// `(line, target)` of every inline link or image (`](target)`) and reference definition.
fn links(text: &str) -> Vec<(usize, String)> {
    let text = without_code_spans(&prose(text));
    let mut found = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            // `[text](target "title")`: the target is the first word.
            let target = after[..end].split_whitespace().next().unwrap_or("");
            found.push((
                number + 1,
                target.trim_matches(|c| c == '<' || c == '>').to_string(),
            ));
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some(close) = trimmed.find("]:")
            && let Some(target) = trimmed[close + 2..].split_whitespace().next()
        {
            found.push((number + 1, target.to_string()));
        }
    }
    found
}

/// GitHub's anchors for the headings of a Markdown text: lower case, punctuation dropped,
/// spaces as hyphens, `-1`, `-2`… after repeats.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    for line in prose(text).lines() {
        let trimmed = line.trim_start();
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if hashes == 0 || hashes > 6 || !trimmed[hashes..].starts_with(' ') {
            continue;
        }
        let title = trimmed[hashes..].trim().trim_end_matches('#').trim();
        let slug: String = title
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut candidate = slug.clone();
        let mut n = 0;
        while seen.contains(&candidate) {
            n += 1;
            candidate = format!("{slug}-{n}");
        }
        seen.insert(candidate);
    }
    seen
}

/// `path` with `.` and `..` folded, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_relative_link_resolves_to_a_file_and_heading_of_the_repository() {
    let root = root();
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = fs::read_to_string(&page).unwrap();
        let shown = page.strip_prefix(&root).unwrap().display().to_string();
        for (line, target) in links(&text) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                page.clone()
            } else if path.starts_with('/') {
                broken.push(format!("{shown}:{line}: {target}: an absolute path"));
                continue;
            } else {
                normalize(&page.parent().unwrap().join(path))
            };
            if !file.starts_with(&root) {
                broken.push(format!("{shown}:{line}: {target}: outside the repository"));
                continue;
            }
            if !file.exists() {
                broken.push(format!("{shown}:{line}: {target}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor
                && file.extension().is_some_and(|ext| ext == "md")
                && !anchors(&fs::read_to_string(&file).unwrap()).contains(anchor)
            {
                broken.push(format!("{shown}:{line}: {target}: no heading #{anchor}"));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: is the parser blind?"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn no_markdown_file_points_at_the_shared_folder_outside_the_repository() {
    let root = root();
    let mut files = Vec::new();
    markdown_files(&root, &mut files);
    assert!(
        files
            .iter()
            .any(|file| file.ends_with("docs/architecture.md"))
    );
    let offenders: Vec<String> = files
        .iter()
        .filter(|file| fs::read_to_string(file).unwrap().contains("../shared"))
        .map(|file| file.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "these point at ../shared, which a clone does not have: {offenders:?}"
    );
}

#[test]
fn no_page_names_a_folder_of_the_machine_it_was_written_on() {
    let root = root();
    let mut found = Vec::new();
    for page in pages() {
        let text = fs::read_to_string(&page).unwrap();
        let shown = page.strip_prefix(&root).unwrap().display().to_string();
        for (i, line) in text.lines().enumerate() {
            if ["/work/", "/root/", "/home/"]
                .iter()
                .any(|p| line.contains(p))
            {
                found.push(format!("{shown}:{}: {line}", i + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "paths a clone elsewhere does not have:\n{}",
        found.join("\n")
    );
}

#[test]
fn readme_is_a_front_door_with_the_two_set_up_commands() {
    let readme = fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines; move detail into docs/"
    );
    for command in ["cargo run --release --bin zerotrain -- up", "scripts/test"] {
        assert!(
            readme.lines().any(|line| line.trim() == command),
            "README.md shows `{command}` on a line of its own"
        );
    }
    assert!(
        root().join("scripts/test").exists(),
        "scripts/test, README's test command, exists"
    );
}

#[test]
fn the_link_parser_sees_links_and_headings_and_skips_code() {
    let text = "# A title\n\nSee [x](a.md#b-c) and `[no](code.md)` and ``[no](x`y.md)``.\n\
                \n```\n[no](fenced.md)\n```\n\n    [no](indented.md)\n\n\
                [wrapped\ntext](wrapped.md) ![img](p.png \"title\")\n\n## B `c`!\n## B c\n\n\
                [ref]: ref.md\n";
    let targets: Vec<String> = links(text).into_iter().map(|(_, t)| t).collect();
    assert_eq!(targets, ["a.md#b-c", "wrapped.md", "p.png", "ref.md"]);
    let anchors = anchors(text);
    for anchor in ["a-title", "b-c", "b-c-1"] {
        assert!(anchors.contains(anchor), "{anchor} in {anchors:?}");
    }
    assert_eq!(
        normalize(Path::new("/r/docs/../kernels/./README.md")),
        Path::new("/r/kernels/README.md")
    );
}
