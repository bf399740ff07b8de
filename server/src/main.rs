use std::process::ExitCode;

fn main() -> ExitCode {
    server::cli::main()
}
