// ESLint (npm run lint): typescript-eslint's type-checked recommended rules on the TypeScript, ESLint's recommended
// ones on the scripts' JavaScript. Formatting is prettier's job (npm run format), not ESLint's.
import js from '@eslint/js';
import globals from 'globals';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  { ignores: ['dist/', 'build*/', 'node_modules/', '.venv*/', '.cache/', 'docs/', 'python/', 'native/', 'examples/'] },
  js.configs.recommended,
  { languageOptions: { globals: { ...globals.node } } },
  {
    files: ['**/*.ts'],
    extends: [tseslint.configs.recommendedTypeChecked],
    languageOptions: { parserOptions: { project: './tsconfig.check.json', tsconfigRootDir: import.meta.dirname } },
    rules: {
      // Kernels and handlers implement Promise-returning interfaces synchronously; async keeps their throws rejections.
      '@typescript-eslint/require-await': 'off',
      // A leading underscore marks a binding kept on purpose (a destructured field left out of the rest, a callback slot).
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_', ignoreRestSiblings: true }],
      // A let read by a closure made before its one assignment (a fault test arms its killer before the run starts).
      'prefer-const': ['error', { ignoreReadBeforeAssign: true }],
      // Lines within 140 columns: prettier wraps the code; comments are wrapped by hand. Long messages in string and
      // template literals stay whole, searchable as the user sees them.
      'max-len': ['error', { code: 140, ignoreStrings: true, ignoreTemplateLiterals: true, ignoreRegExpLiterals: true, ignoreUrls: true }],
    },
  },
  {
    files: ['test/**/*.ts'],
    rules: {
      // Tests read what they check from JSON.parse, child processes and HTTP bodies (typed any); the assertions
      // check that shape, so typing each value first would restate the expectation without finding more.
      '@typescript-eslint/no-unsafe-argument': 'off',
      '@typescript-eslint/no-unsafe-assignment': 'off',
      '@typescript-eslint/no-unsafe-call': 'off',
      '@typescript-eslint/no-unsafe-member-access': 'off',
      '@typescript-eslint/no-unsafe-return': 'off',
    },
  },
);
