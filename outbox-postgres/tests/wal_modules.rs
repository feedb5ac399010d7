//! The WAL source's modules import each other one way: no module of `src/wal/` imports one that
//! (directly or through others) imports it back. Read from the sources, outside test modules and
//! comments.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each module of `src/wal/` and the sibling modules it names as `super::<module>`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/wal");
    let modules: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .filter(|m| m != "mod")
        .collect();
    modules
        .iter()
        .map(|m| {
            let text = std::fs::read_to_string(dir.join(format!("{m}.rs"))).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            let mut names = BTreeSet::new();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for part in line.split("super::").skip(1) {
                    let name: String = part
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if modules.contains(&name) && &name != m {
                        names.insert(name);
                    }
                }
            }
            (m.clone(), names)
        })
        .collect()
}

/// A module that `from` reaches again through its imports, with the path, if any.
fn cycle_from(from: &str, graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    let mut stack = vec![vec![from.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last().unwrap();
        for next in &graph[last] {
            if next == from {
                let mut cycle = path.clone();
                cycle.push(next.clone());
                return Some(cycle);
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn the_wal_modules_import_each_other_one_way() {
    let graph = imports();
    assert!(graph.len() >= 15, "{graph:?}");
    let cycles: Vec<String> = graph
        .keys()
        .filter_map(|m| cycle_from(m, &graph))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(cycles.is_empty(), "import circles in src/wal/: {cycles:#?}");
}

#[test]
fn a_circle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(m, d)| (m.to_string(), d.into_iter().map(str::to_string).collect()))
    .collect();
    assert_eq!(
        cycle_from("a", &graph),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    assert_eq!(cycle_from("d", &graph), None);
}
