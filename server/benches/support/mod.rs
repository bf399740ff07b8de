//! What the benchmarks share.

/// The value of `--name N` on the command line, if given (`cargo bench` adds flags of its own,
/// which are ignored); panics naming the flag when N is not a number.
pub fn flag(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == name)?;
    let value = args.get(at + 1).and_then(|v| v.parse().ok());
    Some(value.unwrap_or_else(|| panic!("{name} N")))
}
