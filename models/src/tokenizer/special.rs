//! llama.cpp's rules that mark tokens by their text, since GGUF files do not say everything:
//! an end of turn, end of message or fill-in-the-middle token the file does not name is found by
//! its usual text and made a control token; tokens that end generation are listed by text; a
//! few exceptions follow models that use those texts for ordinary tokens.

use std::collections::HashMap;

use super::kind::Kind;

const EOT: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM: &[&str] = &["<|eom_id|>"];
const FIM_PRE: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP: &[&str] = &["<|file_sep|>"];
/// Texts of tokens that end generation.
const EOG: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Always written out (gpt-oss's channel markup).
const SHOWN: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Applies the rules to `kinds`; returns the tokens that end generation. `named(key)` is a token id the file gives under
/// `tokenizer.ggml.{key}_token_id` (in range).
pub(crate) fn mark(
    ids: &HashMap<String, u32>,
    kinds: &mut [Kind],
    named: impl Fn(&str) -> Option<u32>,
    eos: Option<u32>,
) -> Vec<u32> {
    let make_control = |kinds: &mut [Kind], i: u32| kinds[i as usize] = Kind::Control;
    // The first of `names` in byte order, made control, if the file names none.
    let mut find = |given: Option<u32>, names: &[&str]| -> Option<u32> {
        if given.is_some() {
            return given;
        }
        let mut found: Vec<(&str, u32)> = names
            .iter()
            .filter_map(|t| ids.get(*t).map(|&i| (*t, i)))
            .collect();
        found.sort_unstable();
        let (_, i) = *found.first()?;
        make_control(kinds, i);
        Some(i)
    };
    let eot = find(named("eot"), EOT);
    let eom = find(named("eom"), EOM);
    find(named("fim_pre").or(named("prefix")), FIM_PRE);
    find(named("fim_suf").or(named("suffix")), FIM_SUF);
    find(named("fim_mid").or(named("middle")), FIM_MID);
    let fim_pad = find(named("fim_pad"), FIM_PAD);
    let fim_rep = find(named("fim_rep"), FIM_REP);
    let fim_sep = find(named("fim_sep"), FIM_SEP);
    let mut end: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for t in EOG {
        if let Some(&i) = ids.get(*t) {
            end.push(i);
            make_control(kinds, i);
        }
    }
    for t in SHOWN {
        if let Some(&i) = ids.get(*t) {
            kinds[i as usize] = Kind::UserDefined;
        }
    }
    end.extend([eos, eot, eom].into_iter().flatten());
    end.sort_unstable();
    end.dedup();
    let ending = |end: &[u32], t: &str| ids.get(t).filter(|i| end.contains(i)).copied();
    // o200k_harmony and solar-open: `<|end|>` ends a message, not the generation.
    if let Some(e) = ending(&end, "<|end|>") {
        let has = |t: &str| ending(&end, t).is_some();
        let call = has("<|call|>") || has("<|calls|>");
        if call && (has("<|return|>") || has("<|flush|>")) {
            end.retain(|&i| i != e);
            kinds[e as usize] = Kind::UserDefined;
        }
    }
    // Gemma 4 and PLaMo: `</s>` is an ordinary token.
    if let Some(s) = ending(&end, "</s>") {
        if ending(&end, "<|tool_response>").is_some() || ending(&end, "<|plamo:eos|>").is_some() {
            end.retain(|&i| i != s);
            kinds[s as usize] = Kind::Normal;
        }
    }
    end
}
