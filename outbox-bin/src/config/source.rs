//! The configuration before it is typed: the TOML file's values with the environment's overrides
//! laid over them, each override kept as the variable's exact text. Each key's type reads that text
//! itself (a number parses it, a string takes it whole, a list splits it at commas), so the
//! environment never changes what a text setting says (`OUTBOX_KAFKA__TOPIC=0042` is `"0042"`).

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, Error as _, IntoDeserializer, Unexpected, Visitor};
use serde_json::Value;

/// The error of reading a [`Source`]: serde_json's, as the file's values are read by it.
type Error = serde_json::Error;

/// A configuration value: from the file, a table the environment reaches into, or the text of one
/// environment variable.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A value of the file (a table of it included, when no variable sets a key inside it).
    File(Value),
    /// A table a variable sets a key of, in key order.
    Table(Vec<(String, Source)>),
    /// The exact text of an environment variable.
    Env(String),
}

impl Source {
    /// This value with `path` set to the text of a variable, tables made on the way (a value of
    /// the file that stands where a table must go is replaced, as a variable overrides the file).
    #[must_use]
    pub fn with(self, path: &[String], text: String) -> Source {
        let Some((first, rest)) = path.split_first() else {
            return Source::Env(text);
        };
        let mut entries = self.into_entries();
        match entries.iter().position(|(k, _)| k == first) {
            Some(i) => {
                let old = std::mem::replace(&mut entries[i].1, Source::Table(Vec::new()));
                entries[i].1 = old.with(rest, text);
            }
            None => {
                let at = entries.partition_point(|(k, _)| k < first);
                let value = Source::Table(Vec::new()).with(rest, text);
                entries.insert(at, (first.clone(), value));
            }
        }
        Source::Table(entries)
    }

    /// This value's entries, in key order, as a table's (a value that is not a table has none).
    fn into_entries(self) -> Vec<(String, Source)> {
        match self {
            Source::Table(entries) => entries,
            Source::File(Value::Object(map)) => {
                let mut entries: Vec<(String, Source)> =
                    map.into_iter().map(|(k, v)| (k, Source::File(v))).collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                entries
            }
            _ => Vec::new(),
        }
    }
}

impl<'de> IntoDeserializer<'de, Error> for Source {
    type Deserializer = Source;

    fn into_deserializer(self) -> Source {
        self
    }
}

/// Each method of a value of the file goes to serde_json's reader, of a variable's text to
/// [`EnvText`]'s, of a table to the map reader.
macro_rules! by_source {
    ($($method:ident ( $($arg:ident : $ty:ty),* ))*) => {
        $(fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Error> {
            match self {
                Source::File(value) => value.$method($($arg,)* visitor),
                Source::Env(text) => EnvText(text).$method($($arg,)* visitor),
                table @ Source::Table(_) => table.deserialize_any(visitor),
            }
        })*
    };
}

impl<'de> de::Deserializer<'de> for Source {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self {
            Source::File(value) => value.deserialize_any(visitor),
            Source::Env(text) => EnvText(text).deserialize_any(visitor),
            Source::Table(entries) => {
                let mut map = MapDeserializer::new(entries.into_iter());
                let value = visitor.visit_map(&mut map)?;
                map.end()?;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self {
            Source::File(value) => value.deserialize_option(visitor),
            other => visitor.visit_some(other),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self {
            Source::File(value) => value.deserialize_newtype_struct(name, visitor),
            other => visitor.visit_newtype_struct(other),
        }
    }

    by_source! {
        deserialize_bool() deserialize_i8() deserialize_i16() deserialize_i32() deserialize_i64()
        deserialize_i128() deserialize_u8() deserialize_u16() deserialize_u32() deserialize_u64()
        deserialize_u128() deserialize_f32() deserialize_f64() deserialize_char() deserialize_str()
        deserialize_string() deserialize_bytes() deserialize_byte_buf() deserialize_unit()
        deserialize_unit_struct(name: &'static str) deserialize_seq()
        deserialize_tuple(len: usize) deserialize_tuple_struct(name: &'static str, len: usize)
        deserialize_map() deserialize_struct(name: &'static str, fields: &'static [&'static str])
        deserialize_enum(name: &'static str, variants: &'static [&'static str])
        deserialize_identifier() deserialize_ignored_any()
    }
}

/// The text of one environment variable, read as the key's type asks: parsed as a number or a
/// boolean, taken whole as text, split at commas as a list. Only a key of no fixed type (one that
/// takes several kinds of value) gets a guess: a number, a boolean, else text.
#[derive(Debug)]
struct EnvText(String);

impl EnvText {
    fn parsed<T: std::str::FromStr>(&self, exp: &dyn de::Expected) -> Result<T, Error> {
        self.0
            .trim()
            .parse()
            .map_err(|_| Error::invalid_value(Unexpected::Str(&self.0), exp))
    }
}

impl<'de> IntoDeserializer<'de, Error> for EnvText {
    type Deserializer = EnvText;

    fn into_deserializer(self) -> EnvText {
        self
    }
}

/// Numbers: the text parsed as the type asks.
macro_rules! numbers {
    ($($method:ident => $visit:ident: $t:ty),*) => {
        $(fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            let n: $t = self.parsed(&visitor)?;
            visitor.$visit(n)
        })*
    };
}

impl<'de> de::Deserializer<'de> for EnvText {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let text = self.0.trim();
        if let Ok(i) = text.parse::<i64>() {
            return visitor.visit_i64(i);
        }
        if let Ok(f) = text.parse::<f64>() {
            if f.is_finite() {
                return visitor.visit_f64(f);
            }
        }
        match text {
            "true" => visitor.visit_bool(true),
            "false" => visitor.visit_bool(false),
            _ => visitor.visit_string(self.0),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.0.trim() {
            "true" => visitor.visit_bool(true),
            "false" => visitor.visit_bool(false),
            _ => Err(Error::invalid_value(Unexpected::Str(&self.0), &visitor)),
        }
    }

    numbers! {
        deserialize_i8 => visit_i8: i8, deserialize_i16 => visit_i16: i16,
        deserialize_i32 => visit_i32: i32, deserialize_i64 => visit_i64: i64,
        deserialize_i128 => visit_i128: i128, deserialize_u8 => visit_u8: u8,
        deserialize_u16 => visit_u16: u16, deserialize_u32 => visit_u32: u32,
        deserialize_u64 => visit_u64: u64, deserialize_u128 => visit_u128: u128,
        deserialize_f32 => visit_f32: f32, deserialize_f64 => visit_f64: f64,
        deserialize_char => visit_char: char
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_string(self.0)
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_string(self.0)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_string(self.0)
    }

    fn deserialize_bytes<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_byte_buf(self.0.into_bytes())
    }

    fn deserialize_byte_buf<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_byte_buf(self.0.into_bytes())
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    /// A list: the items between commas, each trimmed (`a.*, b`); an empty text is an empty list.
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        let items: Vec<EnvText> = if self.0.trim().is_empty() {
            Vec::new()
        } else {
            self.0
                .split(',')
                .map(|item| EnvText(item.trim().to_string()))
                .collect()
        };
        let mut seq = SeqDeserializer::new(items.into_iter());
        let value = visitor.visit_seq(&mut seq)?;
        seq.end()?;
        Ok(value)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        Err(Error::invalid_type(Unexpected::Str(&self.0), &visitor))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        Err(Error::invalid_type(Unexpected::Str(&self.0), &visitor))
    }

    /// A choice among names (`publisher.type = kafka`): the text is the name.
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_enum(IntoDeserializer::<Error>::into_deserializer(self.0))
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde::Deserialize;
    use std::collections::BTreeMap;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Shape {
        text: String,
        number: u32,
        ratio: f64,
        flag: bool,
        list: Vec<String>,
        numbers: Vec<u16>,
        maybe: Option<String>,
        map: BTreeMap<String, String>,
        any: Value,
    }

    fn env(pairs: &[(&str, &str)]) -> Source {
        let mut root = Source::File(serde_json::json!({"map": {"kept": "from the file"}}));
        for (path, text) in pairs {
            let path: Vec<String> = path.split('/').map(str::to_string).collect();
            root = root.with(&path, text.to_string());
        }
        root
    }

    #[test]
    fn each_type_reads_the_exact_text() {
        let shape = Shape::deserialize(env(&[
            ("text", "0042"),
            ("number", " 7"),
            ("ratio", "1.10"),
            ("flag", "true"),
            ("list", "a.*, b"),
            ("numbers", "1,2"),
            ("maybe", "007"),
            ("map/sasl.password", "0123"),
            ("any", "12"),
        ]))
        .unwrap();
        assert_eq!(shape.text, "0042");
        assert_eq!(shape.number, 7);
        assert_eq!(shape.ratio, 1.1);
        assert!(shape.flag);
        assert_eq!(shape.list, vec!["a.*", "b"]);
        assert_eq!(shape.numbers, vec![1, 2]);
        assert_eq!(shape.maybe.as_deref(), Some("007"));
        assert_eq!(shape.map["sasl.password"], "0123");
        assert_eq!(
            shape.map["kept"], "from the file",
            "the file's other keys stay"
        );
        assert_eq!(
            shape.any,
            serde_json::json!(12),
            "a key of no type gets a guess"
        );
    }

    #[test]
    fn a_text_that_is_not_of_the_type_is_refused_with_the_text() {
        let e = u32::deserialize(Source::Env("12x".into())).unwrap_err();
        assert!(e.to_string().contains("\"12x\""), "{e}");
        let e = bool::deserialize(Source::Env("yes".into())).unwrap_err();
        assert!(e.to_string().contains("\"yes\""), "{e}");
    }

    #[test]
    fn a_variable_overrides_a_file_value_where_a_table_goes() {
        #[derive(Debug, Deserialize)]
        struct Nested {
            a: BTreeMap<String, String>,
            z: BTreeMap<String, u8>,
        }
        let root = Source::File(serde_json::json!({"a": 1, "z": {"y": 2}}));
        let nested = Nested::deserialize(root.with(&["a".into(), "b".into()], "x".into())).unwrap();
        assert_eq!(nested.a["b"], "x");
        assert_eq!(nested.z["y"], 2, "the file's other tables stay");
    }
}
