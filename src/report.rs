//! How the user binaries end on an error: the message and its causes, one line each, and a
//! non-zero exit; the backtrace only where it helps.

use std::backtrace::BacktraceStatus;
use std::process::ExitCode;

/// The exit code for a binary's result: success, or (after printing `Error: ` and the error's
/// chain on stderr) failure. The backtrace that `RUST_BACKTRACE` makes anyhow capture is
/// printed only with `verbose` or where it names its frames: the release binaries are
/// stripped, and a stack of `<unknown>` frames under every message helps nobody.
pub fn exit_code(result: anyhow::Result<()>, verbose: bool) -> ExitCode {
    let Err(e) = result else {
        return ExitCode::SUCCESS;
    };
    eprintln!("{}", message(&e, verbose));
    ExitCode::FAILURE
}

/// What [`exit_code`] prints for `e`.
pub fn message(e: &anyhow::Error, verbose: bool) -> String {
    let bt = e.backtrace();
    let text = (bt.status() == BacktraceStatus::Captured).then(|| bt.to_string());
    render(e, verbose, text.as_deref())
}

/// [`message`] with the backtrace as printed (`None`: none captured).
fn render(e: &anyhow::Error, verbose: bool, backtrace: Option<&str>) -> String {
    let mut out = format!("Error: {e}");
    for cause in e.chain().skip(1) {
        out.push_str(&format!("\n  caused by: {cause}"));
    }
    if let Some(text) = backtrace {
        if verbose || names_frames(text) {
            out.push_str("\n\nbacktrace:\n");
            out.push_str(text);
        }
    }
    out
}

/// Whether a printed backtrace names any of its frames (`  3: crate::module::function`), not
/// only `<unknown>` ones.
fn names_frames(text: &str) -> bool {
    text.lines().any(|l| {
        l.trim_start().split_once(": ").is_some_and(|(n, sym)| {
            !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) && sym.trim() != "<unknown>"
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stripped_backtrace_names_no_frame() {
        let stripped = "   0: <unknown>\n   1: <unknown>\n   2: <unknown>\n";
        assert!(!names_frames(stripped));
        let named =
            "   0: <unknown>\n   1: generate::main\n             at ./examples/generate.rs:9\n";
        assert!(names_frames(named));
    }

    #[test]
    fn the_message_has_every_cause_and_a_stripped_backtrace_only_when_asked() {
        let e = anyhow::anyhow!("cannot read x.gguf").context("--model x.gguf");
        let stripped = "   0: <unknown>\n   1: <unknown>\n";
        for bt in [None, Some(stripped)] {
            let m = render(&e, false, bt);
            assert!(m.starts_with("Error: --model x.gguf"), "{m}");
            assert!(m.contains("caused by: cannot read x.gguf"), "{m}");
            assert!(!m.contains("backtrace") && !m.contains("<unknown>"), "{m}");
        }
        assert!(render(&e, true, Some(stripped)).contains("<unknown>"));
        let named = "   0: generate::main\n";
        assert!(render(&e, false, Some(named)).contains("generate::main"));
    }
}
