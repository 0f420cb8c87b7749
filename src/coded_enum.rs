//! Enums whose variants carry fixed numbers that travel outside the process (wire formats,
//! the C ABI, NCCL's numbering): one macro defines the enum with its numbers, `ALL`, `code()`
//! and `from_code()`, so no hand-kept match can drift from the declaration.
#![forbid(unsafe_code)]

/// `coded_enum! { #[repr(u8)] /** docs */ pub enum Name { A = 1, B = 2 } }` defines the enum (Clone, Copy,
/// Debug, PartialEq, Eq, Hash) and
/// - `Name::ALL`: every variant, in declaration order;
/// - `code(self)`: its number;
/// - `from_code(n) -> Option<Name>`: the variant numbered `n`, None for any other number.
macro_rules! coded_enum {
    (
        #[repr($repr:ident)]
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $code:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant = $code ),+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];

            /// The number this variant stands for outside the process.
            pub const fn code(self) -> $repr {
                self as $repr
            }

            /// The variant numbered `code`, if there is one.
            pub const fn from_code(code: $repr) -> Option<$name> {
                match code {
                    $( $code => Some($name::$variant), )+
                    _ => None,
                }
            }
        }
    };
}
pub(crate) use coded_enum;

#[cfg(test)]
mod tests {
    coded_enum! {
        #[repr(u8)]
        /// A test enum with a gap in its numbers.
        enum Probe {
            A = 1,
            B = 2,
            D = 4,
        }
    }

    #[test]
    fn codes_round_trip_and_gaps_are_none() {
        for p in Probe::ALL {
            assert_eq!(Probe::from_code(p.code()), Some(p));
        }
        assert_eq!(Probe::ALL, [Probe::A, Probe::B, Probe::D]);
        assert_eq!(Probe::from_code(0), None);
        assert_eq!(Probe::from_code(3), None);
        assert_eq!(Probe::from_code(255), None);
    }
}
