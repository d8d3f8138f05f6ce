//! `FromStr` and `Display` for the option enums set by name (on command lines, in JSON
//! configurations): one definition of how a name is read, refused and written back.

/// Implements `FromStr` and `Display` for the fieldless enum `$ty`.
///
/// - Reading trims the text and ignores case; each variant takes its names (the first and
///   any aliases after `|`), written in lower case (the text is compared lowered).
/// - Any other text is refused as `$err { field: $field, reason }` (`$err`, in brackets, a
///   variant of the error type `$errty`); the reason quotes the text and lists every
///   variant's first name.
/// - `Display` writes a variant's first name, so a written value reads back as itself.
macro_rules! keyword_enum {
    (
        $ty:ty, $field:literal, $errty:ty, [$($err:tt)+],
        { $($variant:ident => $name:literal $(| $alias:literal)*),+ $(,)? }
    ) => {
        impl std::str::FromStr for $ty {
            type Err = $errty;
            fn from_str(s: &str) -> std::result::Result<Self, $errty> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($name $(| $alias)* => Ok(Self::$variant),)+
                    _ => Err($($err)+ {
                        field: $field.into(),
                        reason: format!(
                            "{:?} is not one of {}",
                            s.trim(),
                            [$($name),+].join(", ")
                        ),
                    }),
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(match self {
                    $(Self::$variant => $name,)+
                })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use std::fmt::Display;
    use std::str::FromStr;

    use crate::experts::{ExpertAdmission, ExpertPolicy, ExpertRoute, ExpertSlots, ExpertSplit};
    use crate::{EngineKind, OffloadStrategy, PlacementMode, Precision};

    /// Each value written reads back as itself, in any case and with spaces around it.
    fn round_trips<T>(values: &[T])
    where
        T: FromStr + Display + PartialEq + std::fmt::Debug,
        T::Err: std::fmt::Debug,
    {
        for v in values {
            let name = v.to_string();
            assert_eq!(&name.parse::<T>().unwrap(), v);
            assert_eq!(
                &format!(" {} ", name.to_uppercase()).parse::<T>().unwrap(),
                v
            );
        }
    }

    #[test]
    fn names_read_back_as_themselves() {
        round_trips(&[ExpertSlots::Spread, ExpertSlots::Layers]);
        round_trips(&[ExpertAdmission::Always, ExpertAdmission::Repeat]);
        round_trips(&[ExpertRoute::Auto, ExpertRoute::Host, ExpertRoute::Device]);
        round_trips(&[
            ExpertSplit::Auto,
            ExpertSplit::On,
            ExpertSplit::Off,
            ExpertSplit::Fetch,
        ]);
        round_trips(&[Precision::F32, Precision::F16, Precision::BF16]);
        round_trips(&[PlacementMode::Sequential, PlacementMode::Balanced]);
        round_trips(&[EngineKind::Explicit, EngineKind::Managed]);
        round_trips(&[
            OffloadStrategy::Minimal,
            OffloadStrategy::Balanced,
            OffloadStrategy::Aggressive,
        ]);
        // Aliases.
        assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16);
        assert_eq!("none".parse::<Precision>().unwrap(), Precision::F32);
        assert_eq!("um".parse::<EngineKind>().unwrap(), EngineKind::Managed);
    }

    /// A name that is none of them is refused with the field, the text and the names allowed.
    #[test]
    fn other_names_are_refused_with_the_field_and_the_choices() {
        let e = " GPU ".parse::<ExpertRoute>().unwrap_err().to_string();
        assert!(
            e.contains("expert_route") && e.contains("\"GPU\"") && e.contains("auto, host, device"),
            "{e}"
        );
        let e = "rows".parse::<ExpertSlots>().unwrap_err().to_string();
        assert!(
            e.contains("expert_slots") && e.contains("spread, layers"),
            "{e}"
        );
        let e = "lfu:-1".parse::<ExpertPolicy>().unwrap_err().to_string();
        assert!(e.contains("expert_policy") && e.contains("lfu:-1"), "{e}");
        let e = "diagonal".parse::<PlacementMode>().unwrap_err().to_string();
        assert!(
            e.contains("device_map") && e.contains("sequential, balanced"),
            "{e}"
        );
    }
}
